"""Draft-model speculation for a batch: one draft model, one pass per draft position for every
member that drafts, instead of one pass per member and position.

Owns: `SharedDraftModel`, the draft model over a cache pool of its own, and `PooledDraft`, the
per-sequence Proposer whose drafting it batches. The invariant is `DraftModelProposer`'s,
per member: its draft region holds the first `length` tokens of its sequence; a draft round
first feeds each member what is missing (its prompt but the last token after admission, the
pending token and any accepted tokens after a verify), then one token per member per pass;
`commit` truncates the region to the tokens verification kept. Members drafting fewer tokens
leave the rounds early; a member drafting again from the same sequence (multi's next chain, its
region cut back between them) skips the first pass and draws from its kept root row
(`forerun.propose.draft_model.RootRow`). Each member samples from its own q with its own
generator, so a member's drafts do not depend on the others' (up to the draft model's
rounding, which never changes the output: the target verifies every token). A member's
penalties and logit bias shape its q as they shape the target's p (history: its sequence and
the tokens drafted before).
"""

from __future__ import annotations

import torch

from forerun.grammar import GrammarState, apply_masks
from forerun.processors import process_row
from forerun.propose.base import Draft, DraftRequest, Needs
from forerun.propose.draft_model import RootRow
from forerun.runtime.batch import BatchRuntime, PackedBatch
from forerun.sampling import logits_to_probs, sample

# where a batch keeps its SharedDraftModel in ProposerContext.batch: the draft method's
# factory (and multi's) builds a member's PooledDraft from it
SHARED_DRAFT = "draft model"


class SharedDraftModel:
    """The draft model for every member of a batch (its own pool, same slots as the target's)."""

    def __init__(self, runtime: BatchRuntime, target_vocab_size: int):
        self.runtime, self.vocab_size = runtime, target_vocab_size

    def proposer(self, slots: int) -> PooledDraft:
        """A member's proposer; its draft region holds `slots` tokens at most."""
        return PooledDraft(self, slots)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every request's draft, drafting position by position over all of them at once (a
        member drafting again from the same sequence, multi's next chain, starts from its kept
        root row: `RootRow`)."""
        drafted: list[list[torch.Tensor]] = [[] for _ in requests]
        q: list[list[torch.Tensor]] = [[] for _ in requests]
        feeds = {i: torch.tensor(r.tokens[self.runtime.length(r.proposer.handle):],
                                 dtype=torch.long)
                 for i, r in enumerate(requests) if r.k > 0}  # [M_i]: >= 1 unless a row is kept
        known = {i: requests[i].proposer.root.get(requests[i].tokens) for i in feeds}  # [V]
        for depth in range(max((r.k for r in requests), default=0)):
            members = [i for i in feeds if requests[i].k > depth]
            if not members:  # (each left: its k reached, or its grammar allows nothing more)
                break
            best = self._forward([i for i in members if known[i] is None], requests, feeds,
                                 known, depth)
            for i in members:
                r = requests[i]
                row_logits, known[i] = known[i], None  # [V]
                shaped = r.sampling.processing.active or r.proposer.grammar is not None
                if r.sampling.processing.active:  # q shaped as the target's p is
                    history = [*r.tokens, *(int(t) for t in drafted[i])]
                    row_logits = process_row(row_logits, r.sampling.processing, history,
                                             r.proposer.prompt_length)
                if r.proposer.grammar is not None:  # only tokens the grammar allows there
                    allowed = r.proposer.grammar.draft_mask([int(t) for t in drafted[i]])
                    if allowed is None:  # nothing may follow: this member's draft ends
                        feeds.pop(i)
                        continue
                    row_logits = apply_masks(row_logits[None], allowed[None])[0]
                if r.sampling.greedy:  # its one-hot row's token; q = None says just that
                    token = row_logits.argmax(-1).cpu() if shaped or i not in best else best[i]
                else:
                    probs = logits_to_probs(row_logits.cpu(), r.sampling)  # [V]
                    token = sample(probs, r.generator)
                    q[i].append(probs)
                drafted[i].append(token)
                feeds[i] = torch.cat([feeds[i], token.view(1)])  # [M_i + 1] after a kept row
        return [Draft(torch.stack(d), torch.stack(qs) if qs else None) if d else Draft.empty()
                for d, qs in zip(drafted, q, strict=True)]  # [K_i], [K_i, V]

    def _forward(self, run: list[int], requests: list[DraftRequest],
                 feeds: dict[int, torch.Tensor], known: dict[int, torch.Tensor | None],
                 depth: int) -> dict[int, torch.Tensor]:
        """One pass over the members in `run`, each fed what its region lacks: their logits
        into `known` (at depth 0 also kept as their root rows), their feeds emptied ->
        their argmax tokens (one host sync for every greedy member)."""
        if not run:
            return {}
        batch = PackedBatch.of([(requests[i].proposer.handle, feeds[i]) for i in run],
                               last_only=True)
        logits = self._to_target_vocab(self.runtime.forward(batch).logits)  # [B, V]
        best = logits.argmax(-1).cpu()  # [B]
        for row, i in enumerate(run):
            known[i], feeds[i] = logits[row], feeds[i][:0]
            if depth == 0:
                requests[i].proposer.root.keep(requests[i].tokens, logits[row])
        return {i: best[row] for row, i in enumerate(run)}

    def backlog(self, proposer: PooledDraft, tokens: list[int]) -> int:
        fed = self.runtime.length(proposer.handle) if proposer.handle >= 0 else 0
        return max(0, len(tokens) - fed - 1)

    def release(self, proposer: PooledDraft) -> None:
        if proposer.handle >= 0:
            self.runtime.release(proposer.handle)
            proposer.handle = -1

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad or cut the draft's logits [B, V_draft] to the target's vocabulary (same
        tokenizer)."""
        size = logits.shape[-1]
        if size >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - size), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


class PooledDraft:
    """One member's draft-model proposer; `group` batches its drafting with the others'."""

    name = "draft"
    needs = Needs(grammar=True)  # the tokens alone; masks its q under a grammar

    def __init__(self, group: SharedDraftModel, slots: int):
        self.group, self.slots, self.handle = group, slots, -1
        self.runtime = group.runtime.single  # the drafter's one-sequence view (its cost curve)
        self.prompt_length = 0  # where its sequence's output starts (the penalties' history)
        self.grammar: GrammarState | None = None  # its sequence's, under structured output
        self.root = RootRow()  # the draft's row after the sequence it last drafted from

    def constrain(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def prefill(self, prompt: list[int]) -> None:
        """Reserve the member's region; the prompt is fed at its first draft round."""
        self.prompt_length = len(prompt)
        self.root = RootRow()
        self.group.release(self)
        self.handle = self.group.runtime.add(min(self.slots, self.group.runtime.capacity))

    def propose(self, tokens, k, sampling, generator) -> Draft:
        return self.group.propose([DraftRequest(self, tokens, k, sampling, generator)])[0]

    def commit(self, num_final: int) -> None:
        rt = self.group.runtime
        rt.truncate(self.handle, min(rt.length(self.handle), num_final))
