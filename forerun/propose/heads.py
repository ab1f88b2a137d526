"""Head drafting: Medusa, Hydra and EAGLE heads propose a chain or a tree from the target's own
features (see `forerun.heads` for the networks, `forerun.tree.grow_tree` for the tree).

Owns: `HeadProposer`, what every head kind shares: the propose step (the lookup branch, the
automatic budget and its calibration, resting, the head's measured seconds, grafting) over a
kind's root (`forerun.propose.medusa` for Medusa and Hydra, `forerun.propose.eagle` for EAGLE
and EAGLE-3). It never knows which kind it drafts for: a kind brings its root's
log-probabilities and how to expand a level (`_root`), and takes in the features it is fed.
A batch's shared heads (`forerun.propose.medusa.SharedHeads`) may compute the roots of several
members in one call and hand each its own (`propose(..., root=...)`); the rest of the step is
the member's, the same as alone. A batch's EAGLE head (`forerun.propose.eagle.SharedEagle`) also
grows every member's tree in lockstep through `drafting`, the propose step as a generator of
the tree levels it needs.
Invariant: the proposer has been fed the target's features of every token in the target's
cache (all tokens but the pending one).
Without `prompt_features` (where each hidden row costs an LM-head row: llama.cpp) the prompt
is prefilled without hidden states, in the one pass plain decoding makes (so its numerics
stay plain's); the heads draft from the first generated token's feature on.
Head drafts are deterministic (top-k choices, q = None), which the verifier treats as one-hot
proposals: lossless under sampling too.
With tree = AUTO_TREE the node budget is chosen per step from the target's verify-cost curve
(`forerun.tree.best_budget`): the tree is grown to AUTO_TREE_MAX nodes, then cut to the size with
the most expected tokens per second, the head's path confidences scaled by how well they have
predicted acceptance so far in this sequence, and the head's own measured seconds a step added
to a drafting step's cost; where it keeps choosing no draft, the head rests for a growing
number of steps between probes (plain decoding, without the head's cost).
With a `lookup` branch (heads + prompt lookup) the prompt-lookup continuation joins the tree as
one more path from the root (sharing the nodes it agrees with), priced by its own measured
acceptance; the automatic budget then cuts heads' and lookup's nodes by one ranking, and while
the head rests the lookup chain may still be drafted alone.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from time import perf_counter
from typing import NamedTuple

import torch

from forerun.heads import Heads
from forerun.propose.base import Draft, Needs
from forerun.propose.ngram import LookupBranch
from forerun.sampling import SamplingConfig
from forerun.tree import (
    Candidate,
    Level,
    TokenTree,
    best_budget,
    drive,
    graft,
    growing,
    match_depth,
)

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
HEAD_SECONDS_MEMORY = 0.2  # weight of the newest step in the head's running seconds a step
# A root's catch-up over the features that waited (EAGLE's) is priced as a drafting step's
# would be: over at most this many rows (a step's accepted tokens and the next), the rest of a
# rest's or a prompt's backlog being a one-off. Counted whole, it made a probe after a rest
# look like a 17.4 ms drafting step (median, h125 head, EPYC, llama.cpp: 1.8 ms + 0.33 ms a row
# over up to REST_WINDOW rows, then the tree), so the budget kept resting: 90% of steps on five
# Spec-Bench questions, the head drafting in 1-3 steps a reply.
CATCHUP_ROWS = 4
# Where the curve keeps choosing no draft at all (a steep CPU curve), the head is not run for the
# next `idle` steps (features wait, EAGLE's backlog is absorbed in one batched step), then it
# probes again; `idle` doubles after each empty probe, up to MAX_IDLE, and resets on a draft.
MIN_IDLE, MAX_IDLE = 4, 64

# a tree level's log-probabilities [F, N] from its frontier (indices into the candidates so far)
Expand = Callable[[list[int], list[Candidate]], torch.Tensor]
Budget = int | Callable[[list[float]], int]  # grow_tree's: a node count, or one from the scores
VerifyCurve = Callable[[float], float]  # the target's seconds per forward of n tokens


class Root(NamedTuple):
    """What a kind's head makes of the fed features, before the tree grows."""

    logprobs: torch.Tensor  # [N] the first draft token's log-probabilities
    expand: Expand  # the next level's log-probabilities (grow_tree's `expand`)
    caught_up: int = 0  # feature rows the root took in (priced at CATCHUP_ROWS at most)
    seconds: float = 0.0  # what computing it cost this proposer (measured in `propose`)


class Ask(NamedTuple):
    """A tree level a drafting proposer needs: its root's children of `frontier` (indices into
    `found`, the candidates so far)."""

    root: Root
    frontier: list[int]
    found: list[Candidate]


Tree = tuple[list[int], list[int]]  # a grown draft tree: (draft-vocabulary ids, parents)
Growing = Generator[Ask, tuple[torch.Tensor, float], Tree]  # a tree growing (see `drafting`)


class HeadProposer(ABC):
    """A head kind's drafting over the shared propose step; a FeatureProposer."""

    # a head step's cost (`forerun profile heads`: int8 ~2% of a torch bf16 target pass, 3-10% of
    # a llama.cpp one; w8a8 ~5% of llama.cpp's on an AVX2-only CPU) is measured as it drafts
    # (head_seconds) and priced by the automatic budget
    runtime = None
    group = None  # drafts alone, through propose
    shared_store = False  # keeps state in the sequence's stores (Needs.shared_store)

    def __init__(self, heads: Heads, capacity: int, tree: int = 0, topk: int = 4,
                 verify: VerifyCurve | None = None, prompt_features: bool = True,
                 lookup: LookupBranch | None = None):
        """`capacity`: the tokens a sequence may hold (the target's context); `tree`: node
        budget (0 = a chain of k, AUTO_TREE = from `verify`, the target's seconds per forward
        of n tokens); `topk`: children per expanded node; `prompt_features`: read the prompt's
        features after prefill (else start drafting from the first generated token's);
        `lookup`: also draft the prompt-lookup continuation."""
        if tree == AUTO_TREE and verify is None:
            raise ValueError("an automatic tree budget needs the target's verify-cost curve")
        self.heads, self.cfg, self.capacity = heads, heads.cfg, capacity
        self.name = self.cfg.kind
        self.tree, self.topk, self.verify = tree, topk, verify
        # the head runs on heads.device (a torch target's GPU, say); ids map back on the CPU
        self.device, self.vocab_ids = heads.device, heads.vocab_ids.cpu()  # [N]
        self.prompt_features, self.lookup = prompt_features, lookup
        # the target's features it drafts from, of the prompt: its last `_prompt_rows()`
        self.needs = Needs(self.cfg.layers, prompt_features, self._prompt_rows(),
                           shared_store=self.shared_store)
        if lookup is not None:
            self.name = f"{self.name}+lookup"
        self.prefill([])

    # --- what each kind brings --------------------------------------------------------------

    @abstractmethod
    def _prompt_rows(self) -> int:
        """How many of the prompt's last rows of features it reads (Needs.prompt_rows)."""

    @abstractmethod
    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        """The target's features (layer -> [n, D]) of the tokens that entered its cache."""

    @abstractmethod
    def _fed(self) -> bool:
        """Whether it holds a feature to draft from (not so after a featureless prefill)."""

    @abstractmethod
    def commit(self, num_final: int) -> None:
        """The first `num_final` tokens are final: roll back what was built on the others."""

    @abstractmethod
    def _root(self, tokens: list[int]) -> Root:
        """Take in the features fed since the last draft; the root of this step's tree."""

    def _levels(self, k: int) -> int:
        """How deep a draft of k tokens can grow (every level one head step)."""
        return k

    def _grow(self, root: Root, k: int, topk: int, budget: Budget) -> Growing:
        """The draft tree's nodes (draft-vocabulary ids, parents), grown level by level: a
        generator of the levels it needs (see `drafting`)."""
        return (yield from self._asking(root, growing(root.logprobs, depth=k, topk=topk,
                                                      beam=topk, budget=budget)))

    def _asking(self, root: Root, grow: Generator[Level, torch.Tensor, Tree]) -> Growing:
        """`grow`'s levels asked as Asks of this root; the time it waits for an answer beyond
        the seconds the answer charges it is not its own (`_away`: a batch's other members')."""
        try:
            asked = next(grow)
            while True:
                paused = perf_counter()
                logprobs, seconds = yield Ask(root, *asked)
                self._away += perf_counter() - paused - seconds
                asked = grow.send(logprobs)
        except StopIteration as done:
            return done.value

    # --- the shared step --------------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> None:
        # automatic budget: the confidence scale's discounted evidence, the last head draft's
        # (len(tokens), target ids, parents, predicted accepted), the lookup nodes it took,
        # steps left resting and the next rest's length
        self.predicted = self.observed = 0.0
        self._pending: tuple[int, list[int], list[int], float] | None = None
        self._take, self._predicted = 0, 0.0
        self.idle, self.skip = MIN_IDLE, 0
        self.rested = False  # the features fed since the last draft are a rest's
        self.head_seconds = 0.0  # running seconds the head spends a drafting step
        if self.lookup is not None:
            self.lookup.reset()

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

    def runs_head(self, k: int) -> bool:
        """Whether `propose` of k tokens runs the head now: it has a feature (not so after a
        featureless prefill) and is not resting."""
        return k > 0 and self._fed() and self.skip == 0

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator, root: Root | None = None) -> Draft:
        """As Proposer's; `root`: this step's root, computed with other members' in one call
        (given only where `runs_head(k)`); None = its own `_root`. Each tree level comes from
        the root's own `expand`."""

        def answer(ask: Ask) -> tuple[torch.Tensor, float]:
            started = perf_counter()
            return ask.root.expand(ask.frontier, ask.found), perf_counter() - started

        return drive(self.drafting(tokens, k, root), answer)

    def drafting(self, tokens: list[int], k: int, root: Root | None = None
                 ) -> Generator[Ask, tuple[torch.Tensor, float], Draft]:
        """`propose` as a generator: it yields each tree level it needs (an Ask) and is sent
        that level's log-probabilities [F, N] with the seconds they cost this proposer, and
        returns the Draft; so a batch's shared heads can grow every member's tree in
        lockstep, one call a level for all of them (`forerun.propose.eagle.SharedEagle`)."""
        self._learn(tokens)
        chain, chain_scores = self.lookup.propose(tokens, k) if self.lookup and k else ([], [])
        if not self.runs_head(k):  # no feature yet, or resting: lookup alone
            if k and self._fed():  # a rest's step: the verify curve has not wanted a draft
                self.skip -= 1
            return self._lookup_only(chain, chain_scores)
        if root is None:
            started = perf_counter()
            root = self._root(tokens)
            grown = perf_counter()  # the tree grows from here
            root = root._replace(seconds=grown - started)
        else:
            grown = perf_counter()
        self._away = 0.0
        k = self._levels(k)
        if self.lookup is not None:
            k = min(k, LOOKUP_HEAD_DEPTH)
        budget: Budget = self.tree or k
        topk = self.topk if self.tree else 1
        self._take = len(chain)
        if self.tree == AUTO_TREE:
            budget = self._auto_budget(chain_scores)
        ids, parents = yield from self._grow(root, k, topk, budget)
        # a backlog's catch-up (over more than CATCHUP_ROWS rows) is priced at a step's rows
        elapsed = (perf_counter() - grown - self._away
                   + root.seconds * min(1.0, CATCHUP_ROWS / max(1, root.caught_up)))
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

    def _auto_budget(self, chain_scores: list[float]) -> Callable[[list[float]], int]:
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
