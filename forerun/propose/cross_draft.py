"""Draft-model speculation across vocabularies: a draft model whose tokenizer is not the
target's drafts for it through a `VocabBridge` (forerun.propose.cross_vocab).

- Greedy: string-level exact match (as Hugging Face's universal assisted generation). The draft
  continues the target's text greedily in its own tokens; the target's tokenizer re-tokenizes
  that text and its first k target tokens are the draft (q = None: verified against the
  target's argmax). Token boundaries: at the start, the draft's context is the target's whole
  text re-tokenized by the draft's tokenizer, its last token healed: left out, the draft's
  first step chooses among the tokens that begin with its text (where the target's token ends
  inside one of the draft's, say "):\n" before "\n    return", the draft goes on as it would
  have tokenized the whole); at the end, the draft runs until its text makes k + 1 target
  tokens, and the last is dropped (the text may stop inside it), unless the draft ended its
  reply (its stop token becomes the target's end-of-sequence token).
- Sampling: token-level intersection (TLI). Each step samples from the draft's q restricted to
  the tokens both vocabularies hold (`VocabBridge.scatter`, in target ids, shaped by the
  sequence's penalties, logit bias and grammar as the target's p is): one target token per
  draft token, and rejection sampling against that q is exact for the target.

Owns: each sequence's `CrossState` (the target's text, the draft's tokens for it, what the
draft's cache holds) and the drafting rounds, written once for a batch (`draft_rounds`) over
`DraftPasses`: one draft pass per round over every member still drafting. `CrossVocabProposer`
drafts for one sequence on a Runtime; `SharedCrossDraft` and its members' `PooledCrossDraft`
for a batch on a BatchRuntime. Invariant: a member's draft cache holds `state.cached`; a round
first cuts it back to its longest common prefix with the draft's tokens for the target's text
and feeds the rest, so rejected drafts (and a re-tokenization that differs near the end) cost
only that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from forerun.grammar import GrammarState, apply_masks
from forerun.processors import process_row
from forerun.propose.base import Draft, DraftRequest, Needs
from forerun.propose.cross_vocab import VocabBridge, char_start
from forerun.propose.draft_model import RootRow
from forerun.runtime.base import Runtime
from forerun.runtime.batch import BatchRuntime, PackedBatch
from forerun.sampling import SamplingConfig, logits_to_probs, sample

# re-tokenize only the text after the draft token this many tokens before the end (the rest
# is kept: a text's tokens far from its end do not change when it grows)
ANCHOR_LAG = 16
GREEDY_STEPS_PER_TOKEN = 2  # a greedy draft's most draft-model steps per target token asked
# a batch member's draft region, in draft tokens per target token of its sequence (a draft
# tokenizer with a smaller vocabulary cuts the same text into more tokens)
DRAFT_SLOTS_PER_TOKEN = 2


class CrossState:
    """One sequence's side of the bridge: the target's text, the draft's tokens for it (up to
    an anchor kept, after it re-tokenized each round), the draft cache's tokens."""

    def __init__(self, bridge: VocabBridge):
        self.bridge = bridge
        self.target_ids: list[int] = []
        self.ends: list[int] = []  # byte end of each target token's text
        self.data = bytearray()  # the target tokens' text
        bos = bridge.draft_bos
        self.anchor, self.anchor_ids = 0, bos  # data[:anchor] is anchor_ids (after a BOS)
        self.cached: list[int] = []  # the draft ids in the draft's cache
        self.root = RootRow()  # the draft's row after the sequence it last drafted from

    def draft_ids(self, tokens: list[int]) -> list[int] | None:
        """The draft's tokens for the text of target `tokens`; None while the text ends
        inside a character (a target token split it)."""
        n = 0
        limit = min(len(tokens), len(self.target_ids))
        while n < limit and tokens[n] == self.target_ids[n]:
            n += 1
        cut = self.ends[n - 1] if n else 0
        del self.target_ids[n:], self.ends[n:], self.data[cut:]
        for t in tokens[n:]:
            self.data += self.bridge.target_bytes[t]
            self.target_ids.append(t)
            self.ends.append(len(self.data))
        if cut < self.anchor:
            self.anchor, self.anchor_ids = 0, self.bridge.draft_bos
        tail = self.bridge.to_draft(bytes(self.data[self.anchor:]))
        if tail is None:
            return None
        ids = self.anchor_ids + tail
        self._advance(tail)
        return ids

    def _advance(self, tail: list[int]) -> None:
        """Move the anchor to ANCHOR_LAG draft tokens before the end, where those tokens
        spell the text exactly and a character starts."""
        keep = len(tail) - ANCHOR_LAG
        if keep <= 0:
            return
        end = self.anchor + sum(len(self.bridge.draft_bytes[d]) for d in tail[:keep])
        if self.data[self.anchor:end] != b"".join(self.bridge.draft_bytes[d] for d in tail[:keep]) \
                or char_start(self.data, end) != end:
            return  # (a normalizer or a SentencePiece prefix space: re-tokenize it all)
        self.anchor, self.anchor_ids = end, self.anchor_ids + tail[:keep]


class DraftPasses(Protocol):
    """The draft model's passes for the members of a round (a runtime's one sequence, or a
    batch runtime's sequences by handle)."""

    def truncate(self, member: int, length: int) -> None: ...

    def room(self, member: int) -> int:
        """The most tokens the member's draft cache may hold."""
        ...

    def forward(self, feeds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """Each member fed its tokens [M_i >= 1] -> the draft's logits after each [B, V_draft]."""
        ...


class SoloPasses:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def truncate(self, member: int, length: int) -> None:
        self.runtime.truncate(length)

    def room(self, member: int) -> int:
        return self.runtime.capacity

    def forward(self, feeds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        (_, tokens), = feeds
        return self.runtime.forward(tokens, last_only=True).logits[-1:]  # [1, V_draft]


class PooledPasses:
    def __init__(self, runtime: BatchRuntime):
        self.runtime = runtime

    def truncate(self, member: int, length: int) -> None:
        self.runtime.truncate(member, length)

    def room(self, member: int) -> int:
        return self.runtime.reserved(member)

    def forward(self, feeds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        return self.runtime.forward(PackedBatch.of(feeds, last_only=True)).logits  # [B, V_d]


@dataclass
class _Job:
    """One member's draft in the making."""

    request: DraftRequest
    steps: int  # draft-model steps it may still take
    feed: torch.Tensor  # [M] what its cache lacks before the next step's logits
    known: torch.Tensor | None = None  # [V_draft] the next step's row, kept from before
    heal: torch.Tensor | None = None  # greedy: [E] the first step's choices (token healing),
    healed: int = 0  # ... whose first this many bytes the target's text holds already
    tokens: list[int] = field(default_factory=list)  # greedy: draft ids; sampling: target ids
    q: list[torch.Tensor] = field(default_factory=list)  # sampling: [V] per token
    text: bytearray = field(default_factory=bytearray)  # greedy: the drafted text
    ended: bool = False  # greedy: the draft ended its reply
    done: bool = False


def draft_rounds(bridge: VocabBridge, passes: DraftPasses,
                 requests: list[DraftRequest]) -> list[Draft]:
    """One Draft per request (its `proposer` a cross-vocabulary one: `state`, `member`,
    `grammar`, `prompt_length`), in order; one draft pass per round over the members still
    drafting."""
    jobs = [_start(bridge, passes, r) for r in requests]
    while live := [j for j in jobs if j is not None and not j.done]:
        run = [j for j in live if j.known is None]
        if run:
            logits = passes.forward([(j.request.proposer.member, j.feed) for j in run])
            for j, row in zip(run, logits, strict=True):  # row: [V_draft]
                state = j.request.proposer.state
                state.cached += j.feed.tolist()
                if not j.tokens:
                    state.root.keep(j.request.tokens, row)
                j.known = row
        for j in live:
            row, j.known = j.known, None
            (_greedy_step if j.request.sampling.greedy else _sampled_step)(bridge, j, row)
    return [Draft.empty() if j is None else _finish(bridge, j) for j in jobs]


def _start(bridge: VocabBridge, passes: DraftPasses, r: DraftRequest) -> _Job | None:
    """The member's draft cache cut back to what still holds and what it lacks (None: no
    draft this round)."""
    state, member = r.proposer.state, r.proposer.member
    ids = state.draft_ids(r.tokens) if r.k > 0 else None
    if not ids:
        return None
    steps = r.k if not r.sampling.greedy else GREEDY_STEPS_PER_TOKEN * r.k + 1
    steps = min(steps, passes.room(member) - len(ids))
    if steps < 1:
        return None
    heal, healed = None, 0
    if r.sampling.greedy and len(ids) > 1 + len(bridge.draft_bos) and \
            ids[-1] not in bridge.draft_special:
        heal = bridge.extensions(bridge.draft_bytes[ids[-1]])  # [E]: itself and longer ones
        if len(heal) > 1:  # the draft re-chooses the context's last token among them
            healed, ids = len(bridge.draft_bytes[ids[-1]]), ids[:-1]
        else:
            heal = None
    common = 0
    limit = min(len(ids), len(state.cached))
    while common < limit and ids[common] == state.cached[common]:
        common += 1
    known = state.root.get(r.tokens) if common == len(ids) else None
    if known is None:
        common = min(common, len(ids) - 1)  # the last token fed again: its row is wanted
    passes.truncate(member, common)
    del state.cached[common:]
    return _Job(r, steps, torch.tensor(ids[common:], dtype=torch.long), known, heal, healed)


def _greedy_step(bridge: VocabBridge, j: _Job, row: torch.Tensor) -> None:
    """The draft's argmax, in its own tokens, until its text makes k + 1 target tokens."""
    if j.heal is not None:  # only tokens that begin with the healed one's text
        token, j.heal = int(j.heal[row[j.heal].argmax()]), None
    else:
        token = int(row.argmax())
    j.steps -= 1
    if token in bridge.draft_stops:
        j.ended = j.done = True
        return
    j.tokens.append(token)
    j.text += bridge.draft_bytes[token][j.healed:]
    j.healed = 0
    j.feed = torch.tensor([token])
    j.done = j.steps == 0 or len(bridge.to_target(bytes(j.text))) > j.request.k


def _sampled_step(bridge: VocabBridge, j: _Job, row: torch.Tensor) -> None:
    """A draw from the draft's q over the shared tokens, shaped as the target's p is."""
    r, proposer = j.request, j.request.proposer
    logits = bridge.scatter(row.cpu())  # [V]
    if r.sampling.processing.active:
        logits = process_row(logits, r.sampling.processing, [*r.tokens, *j.tokens],
                             proposer.prompt_length)
    if proposer.grammar is not None:  # only tokens the grammar allows there
        allowed = proposer.grammar.draft_mask(j.tokens)  # [V]
        if allowed is None:
            j.done = True
            return
        logits = apply_masks(logits[None], allowed[None])[0]
    if not torch.isfinite(logits).any():  # nothing shared is allowed here
        j.done = True
        return
    probs = logits_to_probs(logits, r.sampling)  # [V]
    token = int(sample(probs, r.generator))
    j.tokens.append(token)
    j.q.append(probs)
    j.feed = torch.tensor([bridge.draft_of[token]])
    j.steps -= 1
    j.done = j.steps == 0


def _finish(bridge: VocabBridge, j: _Job) -> Draft:
    if not j.request.sampling.greedy:
        return Draft(torch.tensor(j.tokens, dtype=torch.long),
                     torch.stack(j.q) if j.q else None) if j.tokens else Draft.empty()
    ids = bridge.to_target(bytes(j.text))  # [K'] the target's tokens for the drafted text
    if j.ended and bridge.target_eos is not None:
        ids.append(bridge.target_eos)
    elif ids:
        ids.pop()  # the text may stop inside it
    ids = ids[:j.request.k]
    return Draft(torch.tensor(ids, dtype=torch.long)) if ids else Draft.empty()


class CrossVocabProposer:
    """The draft method for one sequence with a draft model of another vocabulary."""

    name = "draft"
    group = None  # drafts alone, through propose
    needs = Needs(grammar=True)  # the tokens alone; a sampled draft masks its q
    member = 0  # (its runtime holds one sequence)

    def __init__(self, runtime: Runtime, bridge: VocabBridge):
        self.runtime, self.bridge = runtime, bridge
        self.passes = SoloPasses(runtime)
        self.state = CrossState(bridge)
        self.prompt_length = 0  # where the sequence's output starts (the penalties' history)
        self.grammar: GrammarState | None = None  # the sequence's, under structured output

    def constrain(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def prefill(self, prompt: list[int]) -> None:
        self.prompt_length = len(prompt)
        self.state = CrossState(self.bridge)
        self.runtime.truncate(0)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        return draft_rounds(self.bridge, self.passes,
                            [DraftRequest(self, tokens, k, sampling, generator)])[0]

    def commit(self, num_final: int) -> None:
        """Nothing now: the next round cuts the draft's cache back to the text that holds."""


class SharedCrossDraft:
    """A draft model of another vocabulary for every member of a batch (its own pool)."""

    def __init__(self, runtime: BatchRuntime, bridge: VocabBridge):
        self.runtime, self.bridge = runtime, bridge
        self.passes = PooledPasses(runtime)

    def proposer(self, slots: int) -> PooledCrossDraft:
        """A member's proposer, for a sequence of at most `slots` target tokens."""
        return PooledCrossDraft(self, slots)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return draft_rounds(self.bridge, self.passes, requests)

    def backlog(self, proposer: PooledCrossDraft, tokens: list[int]) -> int:
        """(Counted in the target's tokens: the draft's for the same text are about as many.)"""
        return max(0, len(tokens) - len(proposer.state.target_ids) - 1)

    def release(self, proposer: PooledCrossDraft) -> None:
        if proposer.member >= 0:
            self.runtime.release(proposer.member)
            proposer.member = -1


class PooledCrossDraft:
    """One member's proposer; `group` batches its drafting with the others'."""

    name = "draft"
    needs = Needs(grammar=True)

    def __init__(self, group: SharedCrossDraft, slots: int):
        self.group, self.slots, self.member = group, slots, -1  # member: its region's handle
        self.runtime = group.runtime.single  # the drafter's one-sequence view (its cost curve)
        self.state = CrossState(group.bridge)
        self.prompt_length = 0
        self.grammar: GrammarState | None = None

    def constrain(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def prefill(self, prompt: list[int]) -> None:
        """Reserve the member's region; the prompt is fed at its first draft round."""
        self.prompt_length = len(prompt)
        self.state = CrossState(self.group.bridge)
        self.group.release(self)
        rt = self.group.runtime
        self.member = rt.add(min(math.ceil(self.slots * DRAFT_SLOTS_PER_TOKEN), rt.capacity))

    def propose(self, tokens, k, sampling, generator) -> Draft:
        return self.group.propose([DraftRequest(self, tokens, k, sampling, generator)])[0]

    def commit(self, num_final: int) -> None:
        """Nothing now: the next round cuts the region back to the text that holds."""

