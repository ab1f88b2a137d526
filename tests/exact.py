"""Exact output distributions of speculative verification, the verifier's mutants, and the
statistics that tell them apart.

On a vocabulary of a few tokens everything a verify step can do is enumerable: every draft a
drafter can propose (`drafts`: siblings drawn without replacement from q, with its
probability), and for each draft every way the verifier accepts, rejects and recovers
(`verdict_distribution`: min(1, p/q) at each child, then the residual), so the exact
distribution of the tokens one verify step emits is a finite sum (`step_distribution`),
extended with the target's own samples to a fixed length L. For the algorithm that sum is the
target's joint over L tokens, exactly (losslessness, checked in test_verify_power); each
`Bug` is a deliberate deviation whose exact distribution parts from it, and `chain_mutant` /
`tree_mutant` are the same bugs as samplers, run in place of forerun.verify's functions.

Statistics: a chi-square goodness-of-fit test against the exact distribution (cells whose
expected count is below 5 pooled into one), and its power against a mutant from the mutant's
exact distribution: the noncentral chi-square with lambda = n * chi-square divergence, over
the same cells (asymptotic, as the test's own alpha is).

Models for engine-level tests: `TableModel` (logits as a fixed random function of the prefix)
behind the Runtime protocol (`TableRuntime`); `RuntimeTable`, a real runtime (a tiny
transformer, which heads can draft from) read as a table; `Recorder`, a proposer wrapper that
counts the draft tokens proposed at each depth.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from scipy.stats import chi2, ncx2

from forerun.propose.base import Draft
from forerun.runtime.base import Capabilities
from forerun.sampling import sample
from forerun.tree import TokenTree
from forerun.verify import TreeVerdict, Verdict, rejection_sample

Prefix = tuple[int, ...]


@dataclass(frozen=True)
class Bug:
    """One deliberate deviation from forerun.verify; Bug() is the algorithm itself."""

    recovered: str = "residual"  # (i) "p": the recovered token drawn from p;
    # (ii) "support": from p renormalised over the residual's support {p > q} only
    bonus_from_parent: bool = False  # (iii) the bonus token from the row before the last
    q_from_previous: bool = False  # (iv) chain: draft token i tested against q_{i-1}
    unnormalised: bool = False  # (ii, tree) the residual not renormalised before the next
    # sibling is tested against it
    siblings_vs_p: bool = False  # (v) tree: every sibling tested against p, not against the
    # residual the siblings before it left (the recovered token still from the residual)


def one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token]), 1)


def recovered_from(bug: Bug, p_row: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What a (mutant) verifier draws its recovered token from, after rejecting every child
    (unnormalised: `sample` normalises)."""
    if bug.recovered == "p":
        return p_row
    if bug.recovered == "support":
        return p_row * (residual > 0)
    return residual


# --- the mutants as samplers -------------------------------------------------------------------

def chain_mutant(bug: Bug):
    """rejection_sample with `bug`: the real function on altered rows (iii, iv), its recovered
    token redrawn from the wrong distribution (i, ii): the bug's output distribution exactly."""

    def verify(draft_tokens, p, q, generator) -> Verdict:
        K = draft_tokens.shape[0]
        if bug.q_from_previous and q is not None and K > 1:
            q = torch.cat([q[:1], q[:-1]])  # [K, V]: row i is q_{i-1}
        if bug.bonus_from_parent and K > 0:
            p = torch.cat([p[:K], p[K - 1:K]])  # [K+1, V]: the bonus row is p_{K-1}
        verdict = rejection_sample(draft_tokens, p, q, generator)
        n = verdict.num_accepted
        if bug.recovered == "residual" or n == K:
            return verdict
        q_n = q[n] if q is not None else one_hot(int(draft_tokens[n]), p[n])
        wrong = recovered_from(bug, p[n], (p[n] - q_n).clamp_min(0))
        return Verdict([*verdict.tokens[:n], int(sample(wrong, generator))], n)

    return verify


def tree_mutant(bug: Bug):
    """recursive_rejection_sample with `bug`, line for line otherwise: with Bug() it draws the
    same uniforms in the same order and returns the same verdicts (test_verify_power)."""

    def verify(tree: TokenTree, draft_tokens, p, q, generator) -> TreeVerdict:
        path: list[int] = []
        row = 0
        while True:
            original = target = row_of(tree, p, row, bug)  # [V]
            accepted = None
            for child in tree.children[row]:
                x = int(draft_tokens[child])
                proposal = q[child] if q is not None else one_hot(x, target)  # [V]
                tested = original if bug.siblings_vs_p else target
                u = float(torch.rand((), generator=generator, dtype=p.dtype))
                if u * float(proposal[x]) < float(tested[x]):
                    accepted = child
                    break
                target = next_target(target, proposal, bug)
            if accepted is None:
                draw = recovered_from(bug, original, target) if tree.children[row] else target
                last = int(sample(draw, generator))
                return TreeVerdict([int(draft_tokens[i]) for i in path] + [last], path)
            path.append(accepted)
            row = accepted + 1

    return verify


def row_of(tree: TokenTree, p: torch.Tensor, row: int, bug: Bug) -> torch.Tensor:
    """The target row a verifier walks at `row`; (iii) a leaf's bonus row taken from its
    parent's row."""
    if bug.bonus_from_parent and row > 0 and not tree.children[row]:
        return p[tree.parents[row - 1] + 1]
    return p[row]


def next_target(target: torch.Tensor, proposal: torch.Tensor, bug: Bug) -> torch.Tensor:
    """The distribution the next sibling is tested against after a rejection."""
    residual = (target - proposal).clamp_min(0)  # [V]
    total = residual.sum()
    if bug.unnormalised:
        return residual
    return residual / total if total > 0 else target


# --- exact distributions -----------------------------------------------------------------------

def tree_shape(shape: tuple[int, ...]) -> TokenTree:
    """The tree whose every node of level d - 1 (the root for d = 1) has shape[d-1] children,
    level by level: (1, 1, 1) is a chain of 3, (2, 2) a root with 2 children of 2 children."""
    parents, level = [], [-1]
    for width in shape:
        nxt = []
        for parent in level:
            for _ in range(width):
                parents.append(parent)
                nxt.append(len(parents) - 1)
        level = nxt
    return TokenTree(tuple(parents))


@dataclass(frozen=True)
class DraftCase:
    probability: float
    tokens: torch.Tensor  # [N]
    q: torch.Tensor | None  # [N, V]: the distribution each node was drawn from (None: chosen)
    p: torch.Tensor  # [N+1, V]: the target's row after the root and after each node


def drafts(tree: TokenTree, p_of, q_of, prefix: Prefix = ()) -> list[DraftCase]:
    """Every draft of this tree shape after `prefix`, with its probability: node i's token is
    drawn from q_of(its path) renormalised over the tokens its earlier siblings did not take."""
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
        parent = tree.parents[i]
        left = q_of(path_tokens(tokens, parent)).clone()  # [V]
        for sibling in tree.children[parent + 1]:
            if sibling < i:
                left[tokens[sibling]] = 0
        left = left / left.sum()
        for x in range(left.shape[0]):
            if left[x] > 0:
                walk([*tokens, x], [*rows, left], prob * float(left[x]))

    walk([], [], 1.0)
    return out


def verdict_distribution(tree: TokenTree, tokens: torch.Tensor, p: torch.Tensor,
                         q: torch.Tensor | None, bug: Bug = Bug()) -> dict[Prefix, float]:
    """Exact distribution of the tokens the (mutant) verifier emits for this draft: the
    accepted path's tokens, then the recovered or bonus token."""
    out: dict[Prefix, float] = defaultdict(float)

    def walk(row: int, emitted: Prefix, mass: float) -> None:
        original = target = row_of(tree, p, row, bug)
        for child in tree.children[row]:
            x = int(tokens[child])
            proposal = q[child] if q is not None else one_hot(x, target)
            if bug.q_from_previous and q is not None and child > 0:
                proposal = q[child - 1]
            tested = float((original if bug.siblings_vs_p else target)[x])
            q_x = float(proposal[x])
            accept = min(1.0, tested / q_x) if q_x > 0 else float(tested > 0)  # u q_x < t_x
            if accept > 0:
                walk(child + 1, (*emitted, x), mass * accept)
            mass *= 1 - accept
            target = next_target(target, proposal, bug)
        draw = recovered_from(bug, original, target) if tree.children[row] else target
        draw = draw / draw.sum()
        for y in range(draw.shape[0]):
            if draw[y] > 0 and mass > 0:
                out[(*emitted, y)] += mass * float(draw[y])

    walk(0, (), 1.0)
    return out


def extend(emitted: dict[Prefix, float], p_of, length: int,
           prefix: Prefix = ()) -> dict[Prefix, float]:
    """Each emitted sequence continued with the target's own samples to `length` tokens."""
    out: dict[Prefix, float] = defaultdict(float)

    def walk(seq: Prefix, prob: float) -> None:
        if len(seq) >= length:
            out[seq[:length]] += prob
            return
        row = p_of(prefix + seq)
        for y in range(row.shape[0]):
            if row[y] > 0:
                walk((*seq, y), prob * float(row[y]))

    for seq, prob in emitted.items():
        walk(seq, prob)
    return out


def step_distribution(tree: TokenTree, p_of, q_of, length: int, bug: Bug = Bug(),
                      deterministic: bool = False) -> dict[Prefix, float]:
    """One verify step of this tree shape (drafts from q_of; `deterministic`: the verifier is
    told q = None, as for a drafter that chose its tokens), extended to `length` tokens."""
    emitted: dict[Prefix, float] = defaultdict(float)
    for case in drafts(tree, p_of, q_of):
        verdicts = verdict_distribution(tree, case.tokens, case.p,
                                        None if deterministic else case.q, bug)
        for seq, prob in verdicts.items():
            emitted[seq] += case.probability * prob
    return extend(emitted, p_of, length)


def target_joint(p_of, length: int) -> dict[Prefix, float]:
    """The target's own distribution of its next `length` tokens."""
    return extend({(): 1.0}, p_of, length)


def tv(a: dict[Prefix, float], b: dict[Prefix, float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# --- sampling one verify step with a real (or mutant) verifier --------------------------------

def sample_step(verifier, tree: TokenTree, p_of, q_of, length: int, n: int, seed: int,
                deterministic: bool = False) -> dict[Prefix, int]:
    """n verify steps of `verifier` (rejection_sample's signature for a chain, else
    recursive_rejection_sample's) on drafts drawn as `drafts` enumerates them, each output
    continued with the target's samples to `length` tokens; -> counts."""
    cases = drafts(tree, p_of, q_of)
    weights = [c.probability for c in cases]
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    counts: dict[Prefix, int] = defaultdict(int)
    rows: dict[Prefix, list[float]] = {}
    choices = rng.choices(range(len(cases)), weights, k=n)
    for i in choices:
        case = cases[i]
        q = None if deterministic else case.q
        if tree.is_chain:
            verdict = verifier(case.tokens, case.p, q, generator)
        else:
            verdict = verifier(tree, case.tokens, case.p, q, generator)
        seq = tuple(verdict.tokens)
        while len(seq) < length:
            row = rows.get(seq)
            if row is None:
                row = rows[seq] = p_of(seq).tolist()
            seq += (rng.choices(range(len(row)), row)[0],)
        counts[seq[:length]] += 1
    return counts


# --- the statistics ----------------------------------------------------------------------------

def pooled_cells(expected: dict[Prefix, float], n: int, min_count: float = 5.0
                 ) -> dict[Prefix, int]:
    """Outcome -> cell of a chi-square test: its own where n * p >= min_count, else the pool."""
    big = sorted(k for k, p in expected.items() if p * n >= min_count)
    cells = {k: i for i, k in enumerate(big)}
    return {k: cells.get(k, len(big)) for k in expected}


def cell_masses(cells: dict[Prefix, int], dist: dict[Prefix, float]) -> list[float] | None:
    """`dist` summed over the cells; None if it gives mass to an outcome outside them (one
    the reference gives probability 0)."""
    masses = [0.0] * (max(cells.values()) + 1)
    for k, p in dist.items():
        if p > 0 and k not in cells:
            return None
        if p > 0:
            masses[cells[k]] += p
    return masses


def chi_square_pvalue(expected: dict[Prefix, float], counts: dict[Prefix, int]) -> float:
    """Pooled chi-square goodness of fit of `counts` against the exact `expected`; an outcome
    the reference gives probability 0 gives p = 0 (it cannot happen by chance)."""
    n = sum(counts.values())
    cells = pooled_cells(expected, n)
    observed = cell_masses(cells, {k: float(c) for k, c in counts.items()})
    if observed is None:
        return 0.0
    e = [n * x for x in cell_masses(cells, expected)]
    used = [(o, x) for o, x in zip(observed, e, strict=True) if x > 0]
    statistic = sum((o - x) ** 2 / x for o, x in used)
    return float(chi2.sf(statistic, len(used) - 1))


def chi_square_power(expected: dict[Prefix, float], actual: dict[Prefix, float], n: int,
                     alpha: float) -> float:
    """Asymptotic power of `chi_square_pvalue` on n samples from `actual`: P(noncentral
    chi2(df, lambda) > chi2(df)'s alpha critical value), lambda = n * sum over the cells of
    (actual - expected)^2 / expected; 1 where `actual` reaches an impossible outcome."""
    cells = pooled_cells(expected, n)
    a = cell_masses(cells, actual)
    if a is None:
        return 1.0
    used = [(ai, ei) for ai, ei in zip(a, cell_masses(cells, expected), strict=True) if ei > 0]
    df = len(used) - 1
    lam = n * sum((ai - ei) ** 2 / ei for ai, ei in used)
    return float(ncx2.sf(chi2.isf(alpha, df), df, lam))


# --- a tabular model: a target whose every conditional is given ---------------------------------

class TableModel:
    """Next-token logits as a fixed random function of the whole token prefix: scale times a
    standard normal draw seeded by (seed, prefix), plus `noise` times a second draw (a draft
    that agrees with its target often, not always). Each conditional is a lookup, so engine
    runs cost microseconds and the exact joint is read off the same numbers the engine sees."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.0, noise: float = 0.0):
        self.vocab, self.seed, self.scale, self.noise = vocab, seed, scale, noise
        self._logits: dict[Prefix, torch.Tensor] = {}

    def _draw(self, prefix: Prefix, salt: int) -> torch.Tensor:
        key = hash((self.seed, salt, prefix)) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.randn(self.vocab, generator=torch.Generator().manual_seed(key),
                           dtype=torch.float64)

    def logits(self, prefix: Prefix) -> torch.Tensor:
        if prefix not in self._logits:
            z = self.scale * self._draw(prefix, 0)
            if self.noise:
                z = z + self.noise * self._draw(prefix, 1)
            self._logits[prefix] = z
        return self._logits[prefix]


class TableRuntime:
    """A TableModel behind the Runtime protocol: the cache is the token list; a tree pass's row
    sees the cache and its ancestors among the new tokens (tree_mask); keep() compacts to the
    accepted rows as a model's cache would."""

    curve = None  # no calibrated forward-time curve (forerun.profile)
    capabilities = Capabilities()  # tokens in, logits out: nothing optional

    def __init__(self, model: TableModel, capacity: int = 256):
        from conftest import tiny_config

        self.model, self.capacity = model, capacity
        self.config = tiny_config(model.vocab)
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, tokens: torch.Tensor, positions=None, tree_mask=None, last_only=False,
                hidden_layers=(), hidden_from=0):
        from forerun.runtime.base import ForwardOutput

        new = tokens.tolist()
        rows = range(len(new) - 1, len(new)) if last_only else range(len(new))
        logits = []
        for r in rows:
            seen = [j for j in range(r + 1) if tree_mask is None or bool(tree_mask[r, j])]
            logits.append(self.model.logits(tuple(self.tokens) + tuple(new[j] for j in seen)))
        self.tokens += new
        return ForwardOutput(torch.stack(logits))  # [T or 1, V]

    def truncate(self, length: int) -> None:
        del self.tokens[length:]

    def keep(self, start: int, rows: list[int]) -> None:
        self.tokens[start:] = [self.tokens[start + r] for r in rows]


class RuntimeTable:
    """A runtime read as a TableModel: `logits(prefix)` is one pass over the whole prefix
    (cached), so a transformer's exact joint is computed as a table's is. Give it a runtime
    of its own: each lookup resets its cache."""

    def __init__(self, runtime):
        self.runtime = runtime
        self._logits: dict[Prefix, torch.Tensor] = {}

    def logits(self, prefix: Prefix) -> torch.Tensor:
        if prefix not in self._logits:
            self.runtime.truncate(0)
            self._logits[prefix] = self.runtime.forward(torch.tensor(prefix)).logits[-1]  # [V]
        return self._logits[prefix]


class Recorder:
    """A proposer as it is, counting the draft tokens it proposes at each depth (before the
    engine cuts anything), so no deep-draft test is a one-token draft in disguise."""

    def __init__(self, inner):
        self.inner, self.depths = inner, Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        draft = self.inner.propose(tokens, k, sampling, generator)
        self.depths.update(TokenTree.of(draft.parents, len(draft.tokens)).depth)
        return draft
