"""Token trees: the one small type every tree-drafting method builds and the verifier walks.

Owns: the mapping from a parents array to what a target pass over the tree needs. A draft tree
has N nodes in topological order (a parent before its children); node i holds a draft token and
`parents[i]`, the index of its parent, or -1 for a child of the root. The root is the pending
token (the last token of the sequence, not yet in the target's cache), so a verify pass feeds
N + 1 tokens: row 0 is the root, row i + 1 is node i. A chain of K tokens is the tree
parents = [-1, 0, 1, ..., K-2].

    parents [-1, -1, 0, 0, 2]          root
                                       /    \\
                                   n0 (d1)  n1 (d1)
                                   /    \\
                               n2 (d2)  n3 (d2)
                                 |
                               n4 (d3)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import cached_property
from typing import TypeVar

import torch

A, B, R = TypeVar("A"), TypeVar("B"), TypeVar("R")


@dataclass(frozen=True)
class TokenTree:
    parents: tuple[int, ...]  # [N]; parents[i] in -1 .. i-1

    def __post_init__(self):
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come first (-1 = root)")

    @staticmethod
    def chain(n: int) -> TokenTree:
        return TokenTree(tuple(range(-1, n - 1)))

    @staticmethod
    def of(parents: torch.Tensor | list[int] | None, n: int) -> TokenTree:
        """The tree of a Draft: its parents, or a chain of n when it has none."""
        return TokenTree.chain(n) if parents is None else TokenTree(tuple(int(p) for p in parents))

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """[N] depth of each node: 1 for a child of the root."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return tuple(depth)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N + 1] children of each row (row 0 = the root), in node order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (empty for the root, node = -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node paths, one per leaf, in leaf order."""
        return [self.path(i) for i in range(len(self)) if not self.children[i + 1]]

    def mask(self) -> torch.Tensor:
        """[N+1, N+1] bool: row r may attend to row c iff c is r or one of its ancestors
        (the root is everyone's ancestor)."""
        n = len(self) + 1
        m = torch.zeros(n, n, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return m

    def positions(self, start: int) -> torch.Tensor:
        """[N+1] int64 positions of the verify pass: the root at `start`, a node at start+depth."""
        return torch.tensor([start, *(start + d for d in self.depth)], dtype=torch.long)


@dataclass(frozen=True)
class Candidate:
    token: int  # an index into the drafter's vocabulary
    parent: int  # index of the parent candidate, -1 = the root
    depth: int  # 1 for a child of the root
    score: float  # log-probability of the path under the drafter


Level = tuple[list[int], list[Candidate]]  # a level a growing tree asks for: (frontier, found)


def grow_tree(
    root: torch.Tensor,  # [N] the drafter's log-probabilities after the root
    expand,  # (candidates: list[int], all: list[Candidate]) -> [len(candidates), N] logprobs
    depth: int,
    topk: int,
    beam: int,
    budget: int | Callable[[list[float]], int],
) -> tuple[list[int], list[int]]:
    """EAGLE-2's dynamic draft tree: `growing`, each level's log-probabilities from `expand`."""
    return drive(growing(root, depth, topk, beam, budget), lambda level: expand(*level))


def growing(
    root: torch.Tensor,  # [N] the drafter's log-probabilities after the root
    depth: int,
    topk: int,
    beam: int,
    budget: int | Callable[[list[float]], int],
) -> Generator[Level, torch.Tensor, tuple[list[int], list[int]]]:
    """EAGLE-2's dynamic draft tree: grow by drafter confidence, then rerank and prune.

    A generator: it yields each level it needs as (frontier, found), the nodes to expand
    (indices into the candidates so far) and those candidates, and is sent their children's
    log-probabilities [len(frontier), N]; so a batch's trees can grow in lockstep, every
    level of all of them one drafter call (`grow_tree` drives one tree alone).
    Each of the `depth` levels keeps the `topk` children of every expanded node; only the
    `beam` most likely nodes of a level (by path log-probability) are expanded. Of everything
    grown, the `budget` most likely paths' nodes are kept: a child is never likelier than its
    parent, so the kept set is a tree. `budget` may be a function of the grown nodes' path
    log-probabilities, best first, returning how many to keep (see `best_budget`); then only
    frontier nodes it would keep so far are expanded (on a steep verify curve a tree stays
    small, and so does the cost of growing it). Returns
    (tokens, parents) in topological order. A chain is depth = budget, topk = beam = 1.
    """
    found: list[Candidate] = []

    def add(logprobs: torch.Tensor, parents: list[int], d: int) -> None:
        """logprobs [P, N]: the children of each of `parents` (-1 = the root), depth d; one
        top-k and one copy to the host a level (the drafter may run on a GPU)."""
        values, tokens = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)  # [P, k]
        for parent, vs, ts in zip(parents, values.tolist(), tokens.tolist(), strict=True):
            base = found[parent].score if parent >= 0 else 0.0
            for v, t in zip(vs, ts, strict=True):
                if v > float("-inf"):
                    found.append(Candidate(t, parent, d, base + v))

    add(root[None], [-1], 1)
    level = list(range(len(found)))
    def ranked() -> list[int]:
        return sorted(range(len(found)), key=lambda i: (-found[i].score, i))

    for d in range(2, depth + 1):
        frontier = sorted(level, key=lambda i: -found[i].score)[:beam]
        if callable(budget):  # expand only nodes the verify curve would carry as things stand:
            order = ranked()  # a child is never likelier than its parent
            carried = set(order[:budget([found[i].score for i in order])])
            frontier = [i for i in frontier if i in carried]
        if not frontier:
            break
        logprobs = yield frontier, found  # [F, N]
        first = len(found)
        add(logprobs, frontier, d)
        level = list(range(first, len(found)))
    return prune(found, budget)


def drive(steps: Generator[A, B, R], answer: Callable[[A], B]) -> R:
    """Run the generator `steps` to its return value, sending each thing it yields
    `answer(it)`."""
    try:
        asked = next(steps)
        while True:
            asked = steps.send(answer(asked))
    except StopIteration as done:
        return done.value


def prune(found: list[Candidate], budget: int | Callable[[list[float]], int]
          ) -> tuple[list[int], list[int]]:
    """EAGLE-2's rerank: of the grown candidates (topological order), keep the `budget` most
    likely paths' nodes (ties: the earlier node), their ancestors with them. `budget` may be a
    function of the path log-probabilities, best first. -> (tokens, parents) in topological
    order."""
    order = sorted(range(len(found)), key=lambda i: (-found[i].score, i))
    if callable(budget):
        budget = budget([found[i].score for i in order])
    keep = set(order[:budget])
    for i in list(keep):  # ancestors of a kept node are kept (already so unless scores tie)
        while found[i].parent >= 0:
            i = found[i].parent
            keep.add(i)
    order = sorted(keep)
    index = {old: new for new, old in enumerate(order)}
    return ([found[i].token for i in order],
            [index[found[i].parent] if found[i].parent >= 0 else -1 for i in order])


def candidates(scores: list[float], tokens: list[int], parents: list[int]) -> list[Candidate]:
    """A tree grown elsewhere (a GPU's, see forerun.runtime.static.StaticEagleTree), given as
    flat arrays in topological order (parents: indices into them, -1 = the root) -> its
    candidates, as grow_tree finds them: nodes of log-probability -inf (and so their
    descendants) are left out."""
    found: list[Candidate] = []
    index: dict[int, int] = {}
    for i, (score, token, parent) in enumerate(zip(scores, tokens, parents, strict=True)):
        if score > float("-inf") and (parent < 0 or parent in index):
            up = index[parent] if parent >= 0 else -1
            index[i] = len(found)
            found.append(Candidate(token, up, found[up].depth + 1 if up >= 0 else 1, score))
    return found


def best_budget(scores: list[float], verify: Callable[[float], float], scale: float = 1.0,
                overhead: float = 0.0) -> int:
    """How many of the likeliest nodes a verify pass should carry, from its cost curve.

    `scores`: path log-probabilities under the drafter, best first; exp(score) estimates the
    chance the target accepts that node (EAGLE-2: draft confidence tracks acceptance), times
    `scale`, a measured correction. Keeping the n best nodes then yields
    E[tokens] = 1 + scale * (exp(s_1) + ... + exp(s_n)) per pass of n + 1 tokens costing
    verify(n + 1) seconds, plus `overhead`, the drafter's own seconds a step (which a plain
    step does not pay); returns the n (0 = plain decoding) with the most tokens per second.
    A steep curve (a CPU) keeps trees small; a flat one (a GPU) lets them grow.
    """
    best_n, best_rate, expected = 0, 1.0 / verify(1), 1.0
    for n, score in enumerate(scores, start=1):
        expected += scale * math.exp(score)
        rate = expected / (verify(n + 1) + overhead)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def graft(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """The tree (tokens, parents) with `chain` added as a path from the root: its tokens follow
    existing nodes while they match and hang new nodes off the last match after that. Children
    of a node keep distinct tokens; the result stays in topological order."""
    tokens, parents = list(tokens), list(parents)
    node = -1
    for token in chain:
        child = _child(tokens, parents, node, token)
        if child is None:
            tokens.append(token)
            parents.append(node)
            child = len(tokens) - 1
        node = child
    return tokens, parents


def match_depth(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """How deep the tree follows `truth` from the root: the length of its longest path whose
    tokens are a prefix of truth (for a verified draft and the tokens the target accepted, the
    accepted path's length)."""
    node, depth = -1, 0
    for token in truth:
        node = _child(tokens, parents, node, token)
        if node is None:
            break
        depth += 1
    return depth


def _child(tokens: list[int], parents: list[int], node: int, token: int) -> int | None:
    """The child of `node` (-1 = the root) holding `token`, if there is one."""
    return next((i for i, p in enumerate(parents) if p == node and tokens[i] == token), None)
