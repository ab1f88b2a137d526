"""Medusa and Hydra drafting: heads that read the last fed feature only.

Owns: `MedusaProposer` and `HydraProposer`, each kind's root over the shared head step
(`forerun.propose.heads.HeadProposer`). The last fed feature f_t is all they keep; the pending
token x_{t+1} is the target's own sample from it, and the heads draft what follows it (head i
the token x_{t+2+i}), so a draft is at most `num_heads` deep. Of the prompt they read its
last row only; without `prompt_features` they draft from the first generated token's feature
on. They hold no cache over the sequence: nothing to roll back.
"""

from __future__ import annotations

import torch

from forerun.propose.heads import HeadProposer, Root
from forerun.tree import Candidate


class _LastFeatureProposer(HeadProposer):
    """What Medusa and Hydra share: the last fed feature, at most num_heads levels."""

    def _prompt_rows(self) -> int:
        return 1  # the prompt's last row

    def prefill(self, prompt: list[int]) -> None:
        super().prefill(prompt)
        self.last: torch.Tensor | None = None  # [1, D] the last fed feature

    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        self.last = hidden[-1][-1:].to(self.device).float()  # [1, D]

    def _fed(self) -> bool:
        return self.last is not None

    def commit(self, num_final: int) -> None:
        pass  # no cache over the sequence: nothing to roll back

    def _levels(self, k: int) -> int:
        return min(k, self.cfg.num_heads)


class MedusaProposer(_LastFeatureProposer):
    """Medusa-1: every head reads f_t alone, so one pass gives every level's log-probabilities;
    the tree grows from them without running a head again."""

    def _root(self, tokens: list[int]) -> Root:
        lp = self.heads.logits(self.heads.medusa(self.last)[:, 0]).log_softmax(-1)  # [K, N]
        if lp.device.type != "cpu":  # every head's row in one copy, not one a tree level
            lp = lp.cpu()

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            depth = found[frontier[0]].depth  # one level at a time: head `depth` comes next
            return lp[depth].expand(len(frontier), -1)

        return Root(lp[0], expand)


class HydraProposer(_LastFeatureProposer):
    """Hydra: head i reads the state head i-1 left at its parent node (f_t for the first) and
    that node's token (the pending one for the first), so every level is a head step."""

    def _root(self, tokens: list[int]) -> Root:
        heads, state = self.heads, {}
        pending = torch.tensor(tokens[-1:], device=self.device)  # [1]
        z = heads.hydra_step(0, self.last, pending)  # [1, D]

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            parents = torch.cat([state.get(found[i].parent, z) for i in frontier])  # [F, D]
            token = self._target_ids([found[i].token for i in frontier])  # [F]
            out = heads.hydra_step(found[frontier[0]].depth, parents, token)  # [F, D]
            state.update({i: out[r:r + 1] for r, i in enumerate(frontier)})
            return heads.logits(out).log_softmax(-1)

        return Root(heads.logits(z)[0].log_softmax(-1), expand)

    def _target_ids(self, draft_ids: list[int]) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's token ids [F], on the head's device."""
        return self.vocab_ids[torch.tensor(draft_ids, dtype=torch.long)].to(self.device)
