"""Exact distributions for multi-draft verification (tests/exact.py's method, extended):
drafts whose siblings are i.i.d. draws from q (SpecTr's setting), SpecTr's verdicts and its
mutants, the expected tokens a verify pass emits, and the merge of several drafters' drafts
with the mutant that forgets to renormalise q.

`iid_drafts` enumerates every draft of a tree shape whose node tokens are drawn independently
from q(. | path) (tests/exact.py's `drafts` draws siblings without replacement instead);
`spectr_verdicts` is the exact output distribution of forerun.verify_spectr's K-SEQ walk for one
draft, `spectr_mutant` the same walk as a sampler, each with a `SpecBug`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cache

import torch
from exact import DraftCase, Prefix, verdict_distribution

from forerun.propose.base import Draft
from forerun.sampling import sample
from forerun.tree import TokenTree
from forerun.verify import TreeVerdict
from forerun.verify_spectr import optimal_rho, residual


@dataclass(frozen=True)
class SpecBug:
    """One deviation from SpecTr's K-SEQ; SpecBug() is the algorithm."""

    rho: str = "optimal"  # "one": rho = 1 at every k (valid for k = 1 only); "k": rho = k
    # (valid, the other end of the valid range: lossless, accepts less)
    recovered: str = "residual"  # "p": the recovered token drawn from p, not p_res


def rho_of(bug: SpecBug, p_row: torch.Tensor, q_row: torch.Tensor, k: int) -> float:
    if bug.rho == "one":
        return 1.0
    if bug.rho == "k":
        return float(k)
    return _optimal_rho(tuple(p_row.tolist()), tuple(q_row.tolist()), k)


@cache
def _optimal_rho(p_row: tuple[float, ...], q_row: tuple[float, ...], k: int) -> float:
    # (the enumerations meet the same rows thousands of times)
    return optimal_rho(torch.tensor(p_row, dtype=torch.float64),
                       torch.tensor(q_row, dtype=torch.float64), k)


def recovered_row(bug: SpecBug, p_row, q_row, rho, k) -> torch.Tensor:
    return p_row if bug.recovered == "p" else residual(p_row, q_row, rho, k)


def iid_drafts(tree: TokenTree, p_of, q_of, prefix: Prefix = ()) -> list[DraftCase]:
    """Every draft of this tree shape after `prefix`, with its probability: each node's token
    drawn from q_of(its parent's path), independently of its siblings."""
    n = len(tree)
    out: list[DraftCase] = []

    def path_tokens(tokens: list[int], node: int) -> Prefix:
        return prefix + tuple(tokens[i] for i in tree.path(node))

    def walk(tokens: list[int], rows: list[torch.Tensor], prob: float) -> None:
        i = len(tokens)
        if i == n:
            p = torch.stack([p_of(prefix)] + [p_of(path_tokens(tokens, j)) for j in range(n)])
            q = torch.stack(rows) if rows else p[:0]  # [N, V]
            out.append(DraftCase(prob, torch.tensor(tokens, dtype=torch.long), q, p))
            return
        row = q_of(path_tokens(tokens, tree.parents[i]))
        for x in range(row.shape[0]):
            if row[x] > 0:
                walk([*tokens, x], [*rows, row], prob * float(row[x]))

    walk([], [], 1.0)
    return out


def spectr_verdicts(tree: TokenTree, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    bug: SpecBug = SpecBug()) -> dict[Prefix, float]:
    """Exact distribution of the tokens SpecTr's walk emits for this draft."""
    out: dict[Prefix, float] = defaultdict(float)

    def walk(row: int, emitted: Prefix, mass: float) -> None:
        children = tree.children[row]
        if not children:
            draw = p[row]
        else:
            q_row, k = q[children[0]], len(children)
            rho = rho_of(bug, p[row], q_row, k)
            for c in children:
                x = int(tokens[c])
                accept = min(1.0, float(p[row][x]) / (rho * float(q_row[x])))
                if accept > 0:
                    walk(c + 1, (*emitted, x), mass * accept)
                mass *= 1 - accept
            draw = recovered_row(bug, p[row], q_row, rho, k)
        draw = draw / draw.sum()
        for y in range(draw.shape[0]):
            if draw[y] > 0 and mass > 0:
                out[(*emitted, y)] += mass * float(draw[y])

    walk(0, (), 1.0)
    return out


def spectr_mutant(bug: SpecBug):
    """forerun.verify_spectr.spectr_sample with `bug`, line for line otherwise (with SpecBug()
    it draws the same uniforms and returns the same verdicts: test_spectr checks)."""

    def verify(tree: TokenTree, draft_tokens, p, q, generator) -> TreeVerdict:
        path: list[int] = []
        row = 0
        while True:
            children = tree.children[row]
            if not children:
                last = int(sample(p[row], generator))
                return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)
            q_row, k = q[children[0]], len(children)
            rho = rho_of(bug, p[row], q_row, k)
            picked = None
            for c in children:
                x = int(draft_tokens[c])
                u = float(torch.rand((), generator=generator, dtype=p.dtype))
                if u * rho * float(q_row[x]) < float(p[row][x]):
                    picked = c
                    break
            if picked is None:
                last = int(sample(recovered_row(bug, p[row], q_row, rho, k), generator))
                return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)
            path.append(picked)
            row = picked + 1

    return verify


def step_distribution(cases: list[DraftCase], tree: TokenTree, verdicts) -> dict[Prefix, float]:
    """The emitted tokens of one verify step over every draft case (`verdicts(tree, tokens, p,
    q)` -> the exact distribution for one draft)."""
    emitted: dict[Prefix, float] = defaultdict(float)
    for case in cases:
        for seq, prob in verdicts(tree, case.tokens, case.p, case.q).items():
            emitted[seq] += case.probability * prob
    return emitted


def rrs(tree, tokens, p, q) -> dict[Prefix, float]:
    """Recursive rejection sampling's exact verdicts (tests/exact.py)."""
    return verdict_distribution(tree, tokens, p, q)


def expected_tokens(emitted: dict[Prefix, float]) -> float:
    """Tokens one verify pass emits, in expectation: accepted + 1 (recovered or bonus)."""
    return sum(len(seq) * prob for seq, prob in emitted.items())


def merge_unrenormalised(drafts: list[Draft]) -> Draft:
    """A mutant of forerun.propose.multi.merge: the trie, each node keeping the q it was drawn
    from as it is (not renormalised over the tokens its earlier siblings hold)."""
    from forerun.propose.multi import _dense_q

    rows = _dense_q(drafts)
    tokens, parents, q, index = [], [], [], {}
    for d, draft in enumerate(drafts):
        tree = TokenTree.of(draft.parents, len(draft.tokens))
        at: list[int] = []
        for i, token in enumerate(draft.tokens.tolist()):
            parent = -1 if tree.parents[i] < 0 else at[tree.parents[i]]
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                if rows is not None:
                    q.append(rows[d][i])
                tokens.append(token)
                parents.append(parent)
            at.append(node)
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(q) if q else None,
                 torch.tensor(parents, dtype=torch.long))
