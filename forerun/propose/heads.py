"""Head drafting: Medusa, Hydra and EAGLE heads propose a chain or a tree from the target's own
features (see `forerun.heads` for the networks, `forerun.tree.grow_tree` for the tree).

Owns: the per-sequence drafting state of a head. Invariant: the proposer has been fed the
target's features of every token in the target's cache (all tokens but the pending one).
- Medusa/Hydra need only the last fed feature f_t; the pending token x_{t+1} is the target's
  own sample from it, and the heads draft what follows it.
- EAGLE keeps a KV cache of its decoder layer over the sequence: entry t is computed from
  (f_t, x_{t+1}), so features wait until the token after them is known; `committed` entries
  are final, the slots after them hold the last draft tree's nodes and are overwritten.
- Without `prompt_features` (where each hidden row costs an LM-head row: llama.cpp) the prompt
  is prefilled without hidden states, in the one pass plain decoding makes (so its numerics
  stay plain's); the heads draft from the first generated token's feature on, and EAGLE's cache
  starts there (`first`: the sequence position of its slot 0).
Head drafts are deterministic (top-k choices, q = None), which the verifier treats as one-hot
proposals: lossless under sampling too.
With static steps (a GPU: CUDA graphs) EAGLE grows its tree on the device in one replay and
copies the candidates back once (`forerun.runtime.static.StaticEagleTree`); elsewhere
`grow_tree` expands level by level through the host.
With tree = AUTO_TREE the node budget is chosen per step from the target's verify-cost curve
(`forerun.tree.best_budget`): the tree is grown to AUTO_TREE_MAX nodes, then cut to the size with
the most expected tokens per second, the head's path confidences scaled by how well they have
predicted acceptance so far in this sequence, and the head's own measured seconds a step added
to a drafting step's cost; where it keeps choosing no draft, the head rests for a growing
number of steps between probes (plain decoding, without the head's cost); after a long rest
EAGLE restarts its cache at the last REST_WINDOW features.
With a `lookup` branch (heads + prompt lookup) the prompt-lookup continuation joins the tree as
one more path from the root (sharing the nodes it agrees with), priced by its own measured
acceptance; the automatic budget then cuts heads' and lookup's nodes by one ranking, and while
the head rests the lookup chain may still be drafted alone.
"""

from __future__ import annotations

import math
from time import perf_counter

import torch

from forerun.heads import Heads
from forerun.propose.base import Draft, Needs
from forerun.propose.ngram import LookupBranch
from forerun.runtime.static import StaticHeadSteps
from forerun.tree import (
    Candidate,
    TokenTree,
    best_budget,
    candidates,
    graft,
    grow_tree,
    match_depth,
    prune,
)

TREE_SLACK = 256  # EAGLE cache slots past the context for a draft tree's nodes
AUTO_TREE = -1  # SpecConfig.tree: choose each step's node budget from the verify-cost curve
AUTO_TREE_MAX = 32  # nodes grown before an automatic budget cuts the tree
# The confidence scale: observed accepted tokens / predicted, with a prior of CALIBRATION_PRIOR
# predicted tokens at scale CALIBRATION_START, discounted by e^-1 per CALIBRATION_MEMORY newer
# predictions.
CALIBRATION_PRIOR = 2.0
CALIBRATION_START = 1.0
CALIBRATION_MEMORY = 32.0
# With a lookup branch, k sizes the lookup chain; the head's own tree stays at most this deep
# (its acceptance past the third token is small here, and every level costs a head step).
LOOKUP_HEAD_DEPTH = 5
# An automatic budget's tree grown on the device (EAGLE, static steps) grows every level it is
# given (grow_tree stops where the budget carries nothing): it gets the first DEVICE_DEPTH
# levels, then a power of two past the deepest node the last cut kept (twice as many where
# the cut kept all of them). H100, random heads the budget cuts to nothing: all 16 levels of
# a 2-children tree cost 4.4 ms, a graphed target pass 4.1.
DEVICE_DEPTH = 4
HEAD_SECONDS_MEMORY = 0.2  # weight of the newest step in the head's running seconds a step
# EAGLE's catch-up over the features that waited is priced as a drafting step's would be: over
# at most this many rows (a step's accepted tokens and the next), the rest of a rest's or a
# prompt's backlog being a one-off. Counted whole, it made a probe after a rest look like a
# 17.4 ms drafting step (median, h125 head, EPYC, llama.cpp: 1.8 ms + 0.33 ms a row over up to
# REST_WINDOW rows, then the tree), so the budget kept resting: 90% of steps on five
# Spec-Bench questions, the head drafting in 1-3 steps a reply.
CATCHUP_ROWS = 4
# Where the curve keeps choosing no draft at all (a steep CPU curve), the head is not run for the
# next `idle` steps (features wait, EAGLE's backlog is absorbed in one batched step), then it
# probes again; `idle` doubles after each empty probe, up to MAX_IDLE, and resets on a draft.
MIN_IDLE, MAX_IDLE = 4, 64
# EAGLE's catch-up over a prompt's features runs its layer over every row (Zen 3, w8a8: 0.3 s
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
# After a rest, EAGLE takes in only the last this many of the features that waited (its cache
# restarts there, as at a prompt's window): the catch-up costs a layer row per waiting feature
# (EPYC, llama.cpp, a 28k head resting on a writing prompt: ~0.45 ms a generated token, the
# floor's largest host cost), and windows of 32 drafted as well as every row, 16 as 32 (above).
REST_WINDOW = 16
# The sequence's store (ProposerContext.stores) under this name holds its last EAGLE proposer's
# (heads, (capacity, static?), (k cache, v cache, static steps))
EAGLE_STORE = "eagle"


class HeadProposer:
    # a head step's cost (`forerun profile heads`: int8 ~2% of a torch bf16 target pass, 3-10% of
    # a llama.cpp one; w8a8 ~5% of llama.cpp's on an AVX2-only CPU) is measured as it drafts
    # (head_seconds) and priced by the automatic budget
    runtime = None
    group = None  # drafts alone, through propose
    static: StaticHeadSteps | None = None  # EAGLE: its steps in static shapes (CUDA graphs)
    # EAGLE with static steps: grow the draft tree on the device (static.tree); False grows it
    # level by level through the host (`forerun profile gpu` compares the two)
    tree_on_device = True

    def __init__(self, heads: Heads, capacity: int, tree: int = 0, topk: int = 4,
                 verify=None, prompt_features: bool = True, lookup: LookupBranch | None = None,
                 static: bool | None = None, store: dict | None = None,
                 prompt_window: int | None = None):
        """`tree`: node budget (0 = a chain of k, AUTO_TREE = from `verify`, the target's
        seconds per forward of n tokens); `topk`: children per expanded node;
        `prompt_features`: read the prompt's features after prefill (else start drafting from
        the first generated token's); `lookup`: also draft the prompt-lookup continuation;
        `static`: EAGLE steps in static shapes, CUDA graphs on a GPU (default: on a GPU only;
        True on the CPU runs them eagerly, for tests); `store`: the stores of the sequence this
        proposer drafts for (ProposerContext.stores), where EAGLE leaves its cache and graphs to
        the sequence's later proposers (a server makes a proposer per request; recording graphs
        anew each time would cost every one);
        `prompt_window`: EAGLE takes in the features of the prompt's last this many tokens
        only (default: PROMPT_WINDOW, or the shorter window it was trained on)."""
        if tree == AUTO_TREE and verify is None:
            raise ValueError("an automatic tree budget needs the target's verify-cost curve")
        self.heads, self.cfg = heads, heads.cfg
        self.name = self.cfg.kind
        self.tree, self.topk, self.verify = tree, topk, verify
        self.eagle = self.cfg.kind in ("eagle", "eagle3")
        # the head runs on heads.device (a torch target's GPU, say); ids map back on the CPU
        self.device, self.vocab_ids = heads.device, heads.vocab_ids.cpu()  # [N]
        self.prompt_features, self.lookup = prompt_features, lookup
        trained = self.cfg.training.get("config", {}).get("seq_len") or PROMPT_WINDOW
        self.prompt_window = prompt_window or min(PROMPT_WINDOW, trained)
        # the target's features it drafts from: of the prompt, EAGLE's window or Medusa's and
        # Hydra's last row (prefill sets `hidden_from`, the first of them, to match)
        self.needs = Needs(self.cfg.layers, prompt_features,
                           self.prompt_window if self.eagle else 1, shared_store=self.eagle)
        if lookup is not None:
            self.name = f"{self.name}+lookup"
        if self.eagle:
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
        self.prefill([])

    def prefill(self, prompt: list[int]) -> None:
        self.last: torch.Tensor | None = None  # [1, D] medusa/hydra: the last fed feature
        self.waiting: list[torch.Tensor] = []  # eagle: features not yet in its cache
        self.committed = 0  # eagle: final cache entries
        # eagle: the sequence position of cache slot 0 (the first generated token's without
        # prompt features; else the start of the prompt's last `prompt_window` tokens, whose
        # features alone the first feed passes on)
        self.first = (max(0, len(prompt) - self.prompt_window) if self.prompt_features
                      else len(prompt))
        # the prompt rows it reads: EAGLE's window, Medusa's and Hydra's last row
        self.hidden_from = self.first if self.eagle else max(0, len(prompt) - 1)
        self._prompt_rows = len(prompt) - self.hidden_from if self.prompt_features else 0
        # automatic budget: the confidence scale's discounted evidence, the last head draft's
        # (len(tokens), target ids, parents, predicted accepted), the lookup nodes it took,
        # steps left resting and the next rest's length
        self.predicted = self.observed = 0.0
        self._pending: tuple[int, list[int], list[int], float] | None = None
        self._take, self._predicted = 0, 0.0
        self.idle, self.skip = MIN_IDLE, 0
        self.rested = False  # eagle: the features waiting are a rest's (see REST_WINDOW)
        self.head_seconds = 0.0  # running seconds the head spends a drafting step
        self.device_depth = DEVICE_DEPTH  # levels an automatic budget's device tree grows
        if self.lookup is not None:
            self.lookup.reset()

    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        if self.eagle:
            if self._prompt_rows:  # the prompt's features: only the window's rows
                hidden = {i: h[-self._prompt_rows:] for i, h in hidden.items()}
                self._prompt_rows = 0
            self.waiting.append(self.heads.feature(hidden))  # [n, D]
        else:
            self.last = hidden[-1][-1:].to(self.device).float()  # [1, D]

    def commit(self, num_final: int) -> None:
        self.committed = min(self.committed, num_final - self.first)

    def _learn(self, tokens: list[int]) -> None:
        """An automatic budget's last head draft: how deep its tree followed the accepted
        tokens (all but the pending one) vs the acceptance its confidences predicted."""
        if self._pending is None:
            return
        length, ids, parents, predicted = self._pending
        self._pending = None
        keep = math.exp(-predicted / CALIBRATION_MEMORY)
        self.observed = keep * self.observed + match_depth(ids, parents, tokens[length:-1])
        self.predicted = keep * self.predicted + predicted

    @property
    def scale(self) -> float:
        """Accepted tokens per unit of predicted confidence, so far (1 before any evidence)."""
        return ((self.observed + CALIBRATION_START * CALIBRATION_PRIOR)
                / (self.predicted + CALIBRATION_PRIOR))

    @torch.inference_mode()
    def propose(self, tokens, k, sampling, generator) -> Draft:
        self._learn(tokens)
        chain, chain_scores = self.lookup.propose(tokens, k) if self.lookup and k else ([], [])
        if k == 0 or (self.last is None and not self.waiting and not self.committed):
            # no feature yet (the first step after a featureless prefill): lookup alone
            return self._lookup_only(chain, chain_scores)
        if self.skip > 0:  # the verify curve has not wanted a draft lately
            self.skip -= 1
            return self._lookup_only(chain, chain_scores)
        started, caught_up = perf_counter(), 0
        if self.eagle:
            root, expand, (root_o, root_pos) = self._eagle(tokens)
            caught_up = self._caught_up
        elif self.cfg.kind == "medusa":
            root, expand = self._medusa()
        else:
            root, expand = self._hydra(torch.tensor(tokens[-1:], device=self.device))  # [1]
        rooted = perf_counter()
        k = min(k, self.cfg.num_heads) if not self.eagle else k
        if self.lookup is not None:
            k = min(k, LOOKUP_HEAD_DEPTH)
        budget = self.tree or k
        topk = self.topk if self.tree else 1
        self._take = len(chain)
        if self.tree == AUTO_TREE:
            budget = self._auto_budget(chain_scores)
        grown = (self.static.tree if self.eagle and self.static is not None
                 and self.tree_on_device else None)
        depth = min(k, self.device_depth) if self.tree == AUTO_TREE else k
        if grown is not None and grown.fits(self.committed, depth, topk, topk):
            # the whole tree on the device, one copy back (a GPU: no round trip per level)
            ids, parents = prune(candidates(*grown.grow(root_o, root, root_pos, self.committed,
                                                        depth, topk, topk)), budget)
            if self.tree == AUTO_TREE:
                self.device_depth = next_depth(parents, depth)
        else:
            ids, parents = grow_tree(root, expand, depth=k, topk=topk, beam=topk, budget=budget)
        elapsed = perf_counter() - started
        if caught_up > CATCHUP_ROWS:  # a backlog's catch-up, priced at a drafting step's rows
            elapsed -= (rooted - started) * (1 - CATCHUP_ROWS / caught_up)
        self.head_seconds = elapsed if not self.head_seconds else (
            self.head_seconds + HEAD_SECONDS_MEMORY * (elapsed - self.head_seconds))
        draft = self.vocab_ids[torch.tensor(ids, dtype=torch.long)].tolist()  # target ids
        if self.tree == AUTO_TREE:  # nothing worth verifying: rest, and rest longer next time
            self.skip, self.idle = (self.idle, min(2 * self.idle, MAX_IDLE)) if not ids else (
                0, MIN_IDLE)
            self.rested = self.skip > 0
            if ids:
                self._pending = (len(tokens), draft, parents, self._predicted)
        if self._take:
            draft, parents = graft(draft, parents, chain[:self._take])
        tree = self.tree or self.lookup is not None
        return Draft(torch.tensor(draft, dtype=torch.long), None,
                     torch.tensor(parents, dtype=torch.long) if tree else None)

    def _lookup_only(self, chain: list[int], scores: list[float]) -> Draft:
        """A step without the head: the lookup chain, cut by the verify curve when automatic."""
        n = best_budget(scores, self.verify) if self.tree == AUTO_TREE else len(chain)
        return Draft(torch.tensor(chain[:n], dtype=torch.long))

    def _auto_budget(self, chain_scores: list[float]):
        """grow_tree's budget: the verify curve's best cut of the AUTO_TREE_MAX likeliest head
        nodes (confidences times the measured scale) and the lookup chain's nodes, ranked
        together; sets how many lookup nodes join (`_take`) and the head's prediction."""
        shift = math.log(self.scale)

        def choose(scores: list[float]) -> int:
            ranked = sorted([(s + shift, True) for s in scores[:AUTO_TREE_MAX]]
                            + [(s, False) for s in chain_scores], key=lambda x: -x[0])
            n = best_budget([s for s, _ in ranked], self.verify, overhead=self.head_seconds)
            heads = sum(is_head for _, is_head in ranked[:n])
            self._take, self._predicted = n - heads, sum(math.exp(s) for s in scores[:heads])
            return heads

        return choose

    def _target_ids(self, draft_ids: list[int]) -> torch.Tensor:
        """Draft-vocabulary ids -> the target's token ids [F], on the head's device."""
        return self.vocab_ids[torch.tensor(draft_ids, dtype=torch.long)].to(self.device)

    # --- each kind: the root's log-probabilities and how to expand a level -------------------

    def _medusa(self):
        lp = self.heads.logits(self.heads.medusa(self.last)[:, 0]).log_softmax(-1)  # [K, N]
        if lp.device.type != "cpu":  # every head's row in one copy, not one a tree level
            lp = lp.cpu()

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            depth = found[frontier[0]].depth  # one level at a time: head `depth` comes next
            return lp[depth].expand(len(frontier), -1)

        return lp[0], expand

    def _hydra(self, pending: torch.Tensor):
        heads, state = self.heads, {}
        z = heads.hydra_step(0, self.last, pending)  # [1, D]

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            parents = torch.cat([state.get(found[i].parent, z) for i in frontier])  # [F, D]
            token = self._target_ids([found[i].token for i in frontier])  # [F]
            out = heads.hydra_step(found[frontier[0]].depth, parents, token)  # [F, D]
            state.update({i: out[r:r + 1] for r, i in enumerate(frontier)})
            return heads.logits(out).log_softmax(-1)

        return heads.logits(z)[0].log_softmax(-1), expand

    def _eagle(self, tokens: list[int]):
        start, first = self.committed, self.first
        # 1. Bring the cache up to the target's: entry t from (f_t, x_{t+1}); slot s holds
        # sequence position first + s (RoPE sees relative positions only).
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
        self.rested = False
        positions = torch.arange(start, start + n)
        nexts = torch.tensor(tokens[first + start + 1:first + start + 1 + n])  # [n]
        o, logprobs = self._step(features, nexts, positions, start,
                                 None if n == 1 else causal(start, n), last_only=True)
        self.committed = start + n  # == len(tokens) - 1 - first
        self._caught_up = n  # rows this catch-up ran over (priced in propose)
        root_o, root_pos = o[-1:], start + n - 1  # [1, D]: predicts the first draft token
        # 2. Drafted nodes append after the committed entries, attending to their ancestors.
        state: dict[int, tuple[torch.Tensor, int]] = {}  # candidate -> (o [1, D], slot)

        def expand(frontier: list[int], found: list[Candidate]) -> torch.Tensor:
            slot = self.committed + len(state)
            feats = torch.cat([state[c.parent][0] if c.parent >= 0 else root_o
                               for c in (found[i] for i in frontier)])  # [F, D]
            token = self.vocab_ids[torch.tensor([found[i].token for i in frontier])]  # [F]
            pos = torch.tensor([root_pos + found[i].depth for i in frontier])  # [F]
            m = torch.zeros(len(frontier), slot + len(frontier), dtype=torch.bool)
            m[:, :self.committed] = True
            for r, i in enumerate(frontier):
                m[r, slot + r] = True
                a = found[i].parent
                while a >= 0:
                    m[r, state[a][1]] = True
                    a = found[a].parent
            out, lp = self._step(feats, token, pos, slot, m)
            state.update({i: (out[r:r + 1], slot + r) for r, i in enumerate(frontier)})
            return lp

        return logprobs[-1], expand, (root_o, root_pos)

    def _step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              slot: int, mask: torch.Tensor | None, last_only: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One EAGLE step: features [T, D], target ids and positions [T] (host), cache slots
        slot.., mask [T, slot+T] (host; None = causal) -> (o [T, D], log-probs [T, N], or of
        the last row at least under last_only: a prompt's catch-up needs no more)."""
        if self.static is not None and self.static.fits(slot, features.shape[0]):
            return self.static.step(features, tokens, positions, slot, mask)
        dev, heads = self.device, self.heads
        o = heads.eagle_step(features, tokens.to(dev), positions.to(dev), self.k_cache,
                             self.v_cache, slot, None if mask is None else mask.to(dev))
        return o, heads.logits(o[-1:] if last_only else o).log_softmax(-1)


def next_depth(parents: list[int], grown: int) -> int:
    """The levels to grow on the device next time, after a cut that kept `parents` of a tree
    `grown` levels deep: the smallest power of two past its deepest node, twice `grown` where
    that node is at the bottom (the tree may have wanted more)."""
    deepest = max(TokenTree(tuple(parents)).depth, default=0)
    if deepest >= grown:
        return 2 * grown
    n = 1
    while n <= deepest:
        n *= 2
    return n


def causal(start: int, n: int) -> torch.Tensor:
    """[n, start+n] bool: every earlier slot, then causal among the n new ones."""
    return torch.cat([torch.ones(n, start, dtype=torch.bool),
                      torch.ones(n, n, dtype=torch.bool).tril()], dim=1)
