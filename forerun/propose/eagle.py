"""EAGLE and EAGLE-3 drafting: a decoder layer over the target's features, with its own cache.

Owns: `EagleProposer`, the EAGLE kinds' root over the shared head step
(`forerun.propose.heads.HeadProposer`). It keeps a KV cache of its decoder layer over the
sequence: entry t is computed from (f_t, x_{t+1}), so features wait until the token after them
is known and are taken in (caught up) at the next draft; `committed` entries are final, the
slots after them hold the last draft tree's nodes and are overwritten. `first` is the sequence
position of cache slot 0: the start of the prompt's window (PROMPT_WINDOW), or without
`prompt_features` the first generated token's; after a long rest the cache restarts at the last
REST_WINDOW features instead of catching up over every one.
With static steps (a GPU: CUDA graphs) it grows its tree on the device in one replay and copies
the candidates back once (`forerun.runtime.static.StaticEagleTree`); elsewhere `grow_tree`
expands level by level through the host.
In a batch, its members' heads step together (`SharedEagle`): one layer call for every
member's catch-up, then one a tree level for all of them, each member's tree still its own.
Its cache and recorded steps outlive it in the sequence's store (EAGLE_STORE): a server makes a
proposer per request, and recording graphs anew each time would cost every one.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, NamedTuple

import torch

from forerun.heads import Heads
from forerun.propose.base import Draft, DraftRequest
from forerun.propose.heads import (
    AUTO_TREE,
    Ask,
    Budget,
    Growing,
    HeadProposer,
    Root,
    VerifyCurve,
    causal,
    next_depth,
)
from forerun.propose.ngram import LookupBranch
from forerun.runtime.static import StaticHeadSteps
from forerun.tree import Candidate, candidates, prune

TREE_SLACK = 256  # cache slots past the context for a draft tree's nodes
# An automatic budget's tree grown on the device (static steps) grows every level it is given
# (grow_tree stops where the budget carries nothing): it gets the first DEVICE_DEPTH levels,
# then a power of two past the deepest node the last cut kept (twice as many where the cut
# kept all of them). H100, random heads the budget cuts to nothing: all 16 levels of a
# 2-children tree cost 4.4 ms, a graphed target pass 4.1.
DEVICE_DEPTH = 4
# The catch-up over a prompt's features runs its layer over every row (Zen 3, w8a8: 0.3 s
# for a 741-token prompt, profiled); it takes in the prompt's last this many tokens (fewer if
# the head was trained on shorter windows). Zen 3, llama.cpp, 28.5k head, 4 EditEval + 2 rag +
# 2 mt_bench prompts: the same accepted lengths with windows of 32, 64, 256 and every row.
# EPYC, llama.cpp, h125 head (int8: a call 3.4 ms + 0.27 ms a row caught up, and the target's
# -hidden FFN over the window's prompt rows in the TTFT), its full trees recorded on 24
# Spec-Bench and 8 EditEval replies (replayed offline): windows of 32, 16 and 8 (this
# and REST_WINDOW) accept the same (oracle cut, mt_bench / translation / summarization / qa
# / math / rag / EditEval: 1.30 / 1.33 / 1.12 / 1.12 / 1.63 / 1.18 / 1.61
# tokens a pass per category with 32, 1.30 / 1.33 / 1.12 / 1.12 / 1.60 / 1.18 / 1.61 with 16);
# 16 it is, the cheaper first step and rests at no measured loss
PROMPT_WINDOW = 16
# After a rest, it takes in only the last this many of the features that waited (its cache
# restarts there, as at a prompt's window): the catch-up costs a layer row per waiting feature
# (EPYC, llama.cpp, a 28k head resting on a writing prompt: ~0.45 ms a generated token, the
# floor's largest host cost), and windows of 32 drafted as well as every row, 16 as 32 (above).
REST_WINDOW = 16
# The sequence's store (ProposerContext.stores) under this name holds its last EAGLE proposer's
# (heads, (capacity, static?), (k cache, v cache, static steps))
EAGLE_STORE = "eagle"
SHARED_EAGLE = "shared eagle"  # ProposerContext.batch: a batch's SharedEagle, by its heads


class EagleRows(NamedTuple):
    """One sequence's rows of an EAGLE layer step (host tensors but the features)."""

    features: torch.Tensor  # [T, D] on the head's device
    tokens: torch.Tensor  # [T] target ids: the token after each feature's
    positions: torch.Tensor  # [T]
    slot: int  # the cache slot of the first row
    mask: torch.Tensor | None  # [T, slot+T] bool; None = causal (T = 1)
    k_cache: torch.Tensor  # the sequence's layer cache [Hkv, capacity, hd]
    v_cache: torch.Tensor


def eagle_rows(heads: Heads, parts: list[EagleRows]) -> torch.Tensor:
    """One step of the EAGLE layer over every part's rows (each in its own cache) -> o [R, D]."""
    dev = heads.device
    if len(parts) == 1:
        features, tokens, positions = parts[0].features, parts[0].tokens, parts[0].positions
    else:
        features = torch.cat([p.features for p in parts])  # [R, D]
        tokens = torch.cat([p.tokens for p in parts])  # [R]
        positions = torch.cat([p.positions for p in parts])  # [R]
    return heads.eagle_steps(features, tokens.to(dev), positions.to(dev), [
        (p.k_cache, p.v_cache, p.slot, len(p.tokens), None if p.mask is None else p.mask.to(dev))
        for p in parts])


class SharedEagle:
    """A batch's EAGLE (or EAGLE-3) head: one layer step for the catch-up of every member that
    runs it this step, then one step a tree level for all of them, their trees grown in
    lockstep (`HeadProposer.drafting`); a BatchDrafter, named by its members as their `group`.
    Each member's cache, tree and budget stay its proposer's: only the head's linears run over
    the members' rows together, so a member drafts what it would alone, up to the rounding of
    a batched matmul (the target verifies every token, so the output cannot change). Members
    with static steps (a GPU's graphs) draft alone."""

    def __init__(self, heads: Heads):
        self.heads = heads

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Every request's draft; the heads' rows of every level of all of them in one call."""
        heads, drafts = self.heads, [None] * len(requests)
        together = [i for i, r in enumerate(requests) if r.proposer.static is None]
        for i, r in enumerate(requests):
            if r.proposer.static is not None:
                drafts[i] = r.proposer.propose(r.tokens, r.k, r.sampling, r.generator)
        runs = [i for i in together if requests[i].proposer.runs_head(requests[i].k)]
        roots: dict[int, Root] = {}
        if runs:  # 1. every running member's catch-up rows in one layer step
            started = perf_counter()
            parts = [requests[i].proposer._catch_up(requests[i].tokens) for i in runs]
            ends = torch.tensor([len(p.tokens) for p in parts]).cumsum(0)
            o = eagle_rows(heads, parts)[ends - 1]  # [B, D] each member's last row
            logprobs = heads.logits(o).log_softmax(-1)  # [B, N]
            share = (perf_counter() - started) / len(runs)
            for b, (i, p) in enumerate(zip(runs, parts, strict=True)):
                roots[i] = requests[i].proposer._rooted(o[b:b + 1], logprobs[b], p)._replace(
                    seconds=share)
        # 2. every member's tree, a level of all of them at a time
        growing = {i: requests[i].proposer.drafting(requests[i].tokens, requests[i].k,
                                                    roots.get(i)) for i in together}
        asks: dict[int, Ask] = {}
        for i, g in growing.items():
            self._next(i, g, None, asks, drafts)
        while asks:
            started = perf_counter()
            members = list(asks)
            parts = [requests[i].proposer._level(asks[i].frontier, asks[i].found)
                     for i in members]
            o = eagle_rows(heads, parts)  # [R, D]
            logprobs = heads.logits(o).log_softmax(-1)  # [R, N]
            share, r = (perf_counter() - started) / len(members), 0
            answers = {}
            for i, p in zip(members, parts, strict=True):
                n = len(p.tokens)
                requests[i].proposer._took(asks[i].frontier, o[r:r + n])
                answers[i], r = (logprobs[r:r + n], share), r + n
            asks = {}
            for i in members:
                self._next(i, growing[i], answers[i], asks, drafts)
        return drafts

    @staticmethod
    def _next(i: int, steps: Growing, answer, asks: dict[int, Ask], drafts: list) -> None:
        """Advance member i's drafting by `answer` (None: start it): its next Ask, or its Draft."""
        try:
            asks[i] = next(steps) if answer is None else steps.send(answer)
        except StopIteration as done:
            drafts[i] = done.value

    def backlog(self, proposer: HeadProposer, tokens: list[int]) -> int:
        return 0  # the heads read the target's features: no model of their own to feed

    def release(self, proposer: HeadProposer) -> None:
        pass  # nothing of the member's to free: its cache is its proposer's


def shared_eagle(batch: dict[str, Any] | None, heads: Heads) -> SharedEagle | None:
    """The batch's SharedEagle for these heads, made for its first member
    (ProposerContext.batch); None for a sequence decoded alone."""
    if batch is None:
        return None
    return batch.setdefault(f"{SHARED_EAGLE} {id(heads)}", SharedEagle(heads))


class EagleProposer(HeadProposer):
    """EAGLE-1 and EAGLE-3 (the latter fuses several target layers into its input feature)."""

    shared_store = True
    static: StaticHeadSteps | None = None  # its steps in static shapes (CUDA graphs)
    # with static steps: grow the draft tree on the device (static.tree); False grows it
    # level by level through the host (`forerun profile gpu` compares the two)
    tree_on_device = True

    def __init__(self, heads: Heads, capacity: int, tree: int = 0, topk: int = 4,
                 verify: VerifyCurve | None = None, prompt_features: bool = True,
                 lookup: LookupBranch | None = None, static: bool | None = None,
                 store: dict | None = None, prompt_window: int | None = None,
                 group: SharedEagle | None = None):
        """As HeadProposer's, and: `static`: steps in static shapes, CUDA graphs on a GPU
        (default: on a GPU only; True on the CPU runs them eagerly, for tests); `store`: the
        stores of the sequence this proposer drafts for (ProposerContext.stores), where it
        leaves its cache and graphs to the sequence's later proposers; `prompt_window`: take
        in the features of the prompt's last this many tokens only (default: PROMPT_WINDOW,
        or the shorter window it was trained on); `group`: the batch's shared head, which
        steps it with the other members (None = it drafts alone)."""
        self.group = group
        trained = heads.cfg.training.get("config", {}).get("seq_len") or PROMPT_WINDOW
        self.prompt_window = prompt_window or min(PROMPT_WINDOW, trained)  # before prefill
        super().__init__(heads, capacity, tree, topk, verify, prompt_features, lookup)
        use_static = self.device.type == "cuda" if static is None else static
        last = store.get(EAGLE_STORE) if store is not None else None
        if last is not None and last[0] is heads and last[1] == (capacity, use_static):
            # the sequence's last proposer's cache (and its recorded graphs): one
            # sequence decodes one request at a time, and prefill resets what is valid
            self.k_cache, self.v_cache, self.static = last[2]
        else:
            self.k_cache, self.v_cache = heads.new_cache(capacity + TREE_SLACK)
            if use_static:
                self.static = StaticHeadSteps(heads, self.k_cache, self.v_cache,
                                              graphs=self.device.type == "cuda")
            if store is not None:
                store[EAGLE_STORE] = (heads, (capacity, use_static),
                                      (self.k_cache, self.v_cache, self.static))

    def _prompt_rows(self) -> int:
        return self.prompt_window

    def prefill(self, prompt: list[int]) -> None:
        super().prefill(prompt)
        self.waiting: list[torch.Tensor] = []  # features not yet in its cache
        self.committed = 0  # final cache entries
        # the sequence position of cache slot 0 (the first generated token's without prompt
        # features; else the start of the prompt's last `prompt_window` tokens, whose features
        # alone the first feed passes on)
        self.first = (max(0, len(prompt) - self.prompt_window) if self.prompt_features
                      else len(prompt))
        self.hidden_from = self.first  # the first prompt row it reads
        self._prompt_rows_left = len(prompt) - self.hidden_from if self.prompt_features else 0
        self.device_depth = DEVICE_DEPTH  # levels an automatic budget's device tree grows

    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        if self._prompt_rows_left:  # the prompt's features: only the window's rows
            hidden = {i: h[-self._prompt_rows_left:] for i, h in hidden.items()}
            self._prompt_rows_left = 0
        self.waiting.append(self.heads.feature(hidden))  # [n, D]

    def commit(self, num_final: int) -> None:
        self.committed = min(self.committed, num_final - self.first)

    def _fed(self) -> bool:
        return bool(self.waiting or self.committed)

    def _root(self, tokens: list[int]) -> Root:
        rows = self._catch_up(tokens)
        o, logprobs = self._step(rows.features, rows.tokens, rows.positions, rows.slot,
                                 rows.mask, last_only=True)
        return self._rooted(o[-1:], logprobs[-1], rows)

    def _catch_up(self, tokens: list[int]) -> EagleRows:
        """The rows that bring the cache up to the target's: entry t from (f_t, x_{t+1}); slot
        s holds sequence position first + s (RoPE sees relative positions only)."""
        start, first = self.committed, self.first
        features = torch.cat(self.waiting)  # [n, D]
        self.waiting = []
        n = features.shape[0]
        if first + start + n != len(tokens) - 1:  # a runtime that returned too few rows
            raise RuntimeError(f"the EAGLE head holds features of {first + start + n} tokens, "
                               f"the target's cache {len(tokens) - 1}")
        window = min(REST_WINDOW, self.prompt_window)
        if self.rested and n > window:  # after a long rest: restart the cache at its window
            features, n, start = features[-window:], window, 0
            self.first = first = len(tokens) - 1 - window
        self.committed = start + n  # == len(tokens) - 1 - first
        return EagleRows(features, torch.tensor(tokens[first + start + 1:first + start + 1 + n]),
                         torch.arange(start, start + n), start,
                         None if n == 1 else causal(start, n), self.k_cache, self.v_cache)

    def _rooted(self, root_o: torch.Tensor, logprobs: torch.Tensor, rows: EagleRows) -> Root:
        """The step's root from the catch-up's last output root_o [1, D] (it predicts the first
        draft token) and its log-probabilities [N]; drafted nodes append after the committed
        entries, attending to their ancestors (`_expand`)."""
        self._root_o, self._root_pos = root_o, self.committed - 1  # a device tree grows from them
        self._nodes: dict[int, tuple[torch.Tensor, int]] = {}  # candidate -> (o [1, D], slot)
        return Root(logprobs, self._expand, caught_up=len(rows.tokens))  # priced in propose

    def _expand(self, frontier: list[int], found: list[Candidate]) -> torch.Tensor:
        """A tree level's log-probabilities [F, N] (grow_tree's `expand`)."""
        rows = self._level(frontier, found)
        o, lp = self._step(rows.features, rows.tokens, rows.positions, rows.slot, rows.mask)
        self._took(frontier, o)
        return lp

    def _level(self, frontier: list[int], found: list[Candidate]) -> EagleRows:
        """The rows of a tree level: each frontier node's parent output and token, in the
        slots after the nodes so far, attending to the committed entries and its ancestors."""
        slot = self.committed + len(self._nodes)
        state = self._nodes
        feats = torch.cat([state[c.parent][0] if c.parent >= 0 else self._root_o
                           for c in (found[i] for i in frontier)])  # [F, D]
        token = self.vocab_ids[torch.tensor([found[i].token for i in frontier])]  # [F]
        pos = torch.tensor([self._root_pos + found[i].depth for i in frontier])  # [F]
        m = torch.zeros(len(frontier), slot + len(frontier), dtype=torch.bool)
        m[:, :self.committed] = True
        for r, i in enumerate(frontier):
            m[r, slot + r] = True
            a = found[i].parent
            while a >= 0:
                m[r, state[a][1]] = True
                a = found[a].parent
        return EagleRows(feats, token, pos, slot, m, self.k_cache, self.v_cache)

    def _took(self, frontier: list[int], o: torch.Tensor) -> None:
        """A level's outputs o [F, D] become its nodes' state (their children read them)."""
        slot = self.committed + len(self._nodes)
        self._nodes.update({i: (o[r:r + 1], slot + r) for r, i in enumerate(frontier)})

    def _grow(self, root: Root, k: int, topk: int, budget: Budget) -> Growing:
        grown = self.static.tree if self.static is not None and self.tree_on_device else None
        depth = min(k, self.device_depth) if self.tree == AUTO_TREE else k
        if grown is None or not grown.fits(self.committed, depth, topk, topk):
            return (yield from super()._grow(root, k, topk, budget))
        # the whole tree on the device, one copy back (a GPU: no round trip per level)
        ids, parents = prune(candidates(*grown.grow(self._root_o, root.logprobs, self._root_pos,
                                                    self.committed, depth, topk, topk)), budget)
        if self.tree == AUTO_TREE:
            self.device_depth = next_depth(parents, depth)
        return ids, parents

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              slot: int, mask: torch.Tensor | None, last_only: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One EAGLE step: features [T, D], target ids and positions [T] (host), cache slots
        slot.., mask [T, slot+T] (host; None = causal) -> (o [T, D], log-probs [T, N], or of
        the last row at least under last_only: a prompt's catch-up needs no more)."""
        if self.static is not None and self.static.fits(slot, features.shape[0]):
            return self.static.step(features, tokens, positions, slot, mask)
        o = eagle_rows(self.heads, [EagleRows(features, tokens, positions, slot, mask,
                                              self.k_cache, self.v_cache)])
        return o, self.heads.logits(o[-1:] if last_only else o).log_softmax(-1)
