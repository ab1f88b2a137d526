"""Medusa and Hydra drafting: heads that read the last fed feature only.

Owns: `MedusaProposer` and `HydraProposer`, each kind's root over the shared head step
(`forerun.propose.heads.HeadProposer`), and `SharedHeads`, the drafter that computes the roots
of a batch's members in one call. The last fed feature f_t is all they keep; the pending
token x_{t+1} is the target's own sample from it, and the heads draft what follows it (head i
the token x_{t+2+i}), so a draft is at most `num_heads` deep. Of the prompt they read its
last row only; without `prompt_features` they draft from the first generated token's feature
on. They hold no cache over the sequence: nothing to roll back.
In a batch, every member that runs the heads this step has its root computed in one call over
the members' stacked features (Medusa: every head's log-probabilities; Hydra: its first head
step); each member then grows its own tree from its row (its lookup branch, budget,
calibration), as it would alone. A proposer alone computes the same over a batch of one, so
its drafts are a batch member's, up to the rounding of a batched matmul (which never changes
the output: the target verifies every token).
Online distillation (`forerun.train.online`): where the engine's shared stores hold a teacher
(ONLINE_TEACHER), each Medusa proposer hands it, after every verify, the position its draft
got wrong (`teach`): the feature its heads drafted from, the first head not accepted, and the
target's logits at that row.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from time import perf_counter
from typing import Any, Protocol

import torch

from forerun.heads import Heads
from forerun.propose.base import Draft, DraftRequest
from forerun.propose.heads import HeadProposer, Root, VerifyCurve
from forerun.propose.ngram import LookupBranch
from forerun.tree import Candidate

SHARED_HEADS = "shared heads"  # ProposerContext.batch: a batch's SharedHeads, by its heads
ONLINE_TEACHER = "online teacher"  # ProposerContext.shared: what learns from wrong positions


class Teacher(Protocol):
    """Where a Medusa proposer's wrong positions go (`forerun.train.online.DistillBuffer`)."""

    def push(self, feature: torch.Tensor, head: int, logits: torch.Tensor) -> None:
        """f_t [D], the head index that was wrong, the target's logits at that row [V]."""
        ...


class SharedHeads:
    """A batch's Medusa or Hydra heads: one call of their network for the roots of every
    member that runs them this step (a BatchDrafter); the members' proposers name it as their
    `group`. It holds nothing of a member's: each member's state is its proposer's."""

    def __init__(self, heads: Heads):
        self.heads = heads

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every request's draft; the roots of those that run the heads in one call."""
        runs = [i for i, r in enumerate(requests) if r.proposer.runs_head(r.k)]
        roots: list[Root | None] = [None] * len(requests)
        if runs:
            started = perf_counter()
            members = [requests[i].proposer for i in runs]
            rows = members[0].roots(torch.cat([m.last for m in members]),  # [B, D]
                                    [requests[i].tokens[-1] for i in runs])
            # each member's automatic budget prices its share of the one call: what its root
            # cost the batch's step
            share = (perf_counter() - started) / len(runs)
            for i, root in zip(runs, rows, strict=True):
                roots[i] = root._replace(seconds=share)
        return [r.proposer.propose(r.tokens, r.k, r.sampling, r.generator, root=root)
                for r, root in zip(requests, roots, strict=True)]

    def backlog(self, proposer: HeadProposer, tokens: list[int]) -> int:
        return 0  # the heads read the target's features: no model of their own to feed

    def release(self, proposer: HeadProposer) -> None:
        pass  # nothing of the member's to free


def shared_heads(batch: dict[str, Any] | None, heads: Heads) -> SharedHeads | None:
    """The batch's SharedHeads for these heads, made for its first member
    (ProposerContext.batch); None for a sequence decoded alone."""
    if batch is None:
        return None
    return batch.setdefault(f"{SHARED_HEADS} {id(heads)}", SharedHeads(heads))


class _LastFeatureProposer(HeadProposer):
    """What Medusa and Hydra share: the last fed feature, at most num_heads levels."""

    def __init__(self, heads: Heads, capacity: int, tree: int = 0, topk: int = 4,
                 verify: VerifyCurve | None = None, prompt_features: bool = True,
                 lookup: LookupBranch | None = None, group: SharedHeads | None = None):
        """As HeadProposer's, and `group`: the batch's shared heads, which compute its roots
        with the other members' (None = it drafts alone)."""
        super().__init__(heads, capacity, tree, topk, verify, prompt_features, lookup)
        self.group = group

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

    def _root(self, tokens: list[int]) -> Root:
        return self.roots(self.last, tokens[-1:])[0]

    @abstractmethod
    def roots(self, last: torch.Tensor, pending: list[int]) -> list[Root]:
        """The roots of B members (sharing these heads) from their last features [B, D] and
        pending tokens, in one call of the heads; nothing of this member's own is read."""


class MedusaProposer(_LastFeatureProposer):
    """Medusa-1: every head reads f_t alone, so one pass gives every level's log-probabilities;
    the tree grows from them without running a head again. With a `teacher` (online
    distillation) it is shown the target's rows after each verify (`Needs.teach`)."""

    def __init__(self, *args, teacher: Teacher | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        if teacher is not None:
            self.needs = replace(self.needs, teach=True)

    def teach(self, draft: Draft, logits: torch.Tensor, path: list[int]) -> None:
        """After a verify of `draft` from the last fed feature f_t: the target's raw logits at
        its rows [1 + nodes, V] (row 0 after the pending token, row j + 1 after node j) and the
        accepted nodes `path`. The row after the accepted path is the target's distribution
        over x_{t+2+i}, i = len(path): head i's, which drafted a rejected token there or none."""
        if self.last is None:
            return
        row = path[-1] + 1 if path else 0
        self.teacher.push(self.last[0], len(path), logits[row])

    def roots(self, last: torch.Tensor, pending: list[int]) -> list[Root]:
        heads = self.heads
        lp = heads.logits(heads.medusa(last)).log_softmax(-1)  # [K, B, N]
        if lp.device.type != "cpu":  # every head's row in one copy, not one a tree level
            lp = lp.cpu()
        return [self._member_root(lp[:, b]) for b in range(lp.shape[1])]

    @staticmethod
    def _member_root(lp: torch.Tensor) -> Root:
        """One member's root from its every head's log-probabilities lp [K, N]."""

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            depth = found[frontier[0]].depth  # one level at a time: head `depth` comes next
            return lp[depth].expand(len(frontier), -1)

        return Root(lp[0], expand)


class HydraProposer(_LastFeatureProposer):
    """Hydra: head i reads the state head i-1 left at its parent node (f_t for the first) and
    that node's token (the pending one for the first), so every level is a head step (the
    first one batched over a batch's members, the others each member's own)."""

    def roots(self, last: torch.Tensor, pending: list[int]) -> list[Root]:
        z = self.heads.hydra_step(0, last, torch.tensor(pending, device=self.device))  # [B, D]
        lp = self.heads.logits(z).log_softmax(-1)  # [B, N]
        return [self._member_root(z[b:b + 1], lp[b]) for b in range(len(pending))]

    def _member_root(self, z: torch.Tensor, logprobs: torch.Tensor) -> Root:
        """One member's root from its first head's state z [1, D] and log-probabilities [N]."""
        heads, state = self.heads, {}

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            parents = torch.cat([state.get(found[i].parent, z) for i in frontier])  # [F, D]
            token = self._target_ids([found[i].token for i in frontier])  # [F]
            out = heads.hydra_step(found[frontier[0]].depth, parents, token)  # [F, D]
            state.update({i: out[r:r + 1] for r, i in enumerate(frontier)})
            return heads.logits(out).log_softmax(-1)

        return Root(logprobs, expand)

    def _target_ids(self, draft_ids: list[int]) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's token ids [F], on the head's device."""
        return self.vocab_ids[torch.tensor(draft_ids, dtype=torch.long)].to(self.device)
