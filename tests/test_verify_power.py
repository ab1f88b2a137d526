"""One verify step, exactly: the verifiers' output distribution against the target's, and
deliberately broken verifiers that the same test must catch (see tests/exact.py).

The setting: a 3-token vocabulary, a target p(. | prefix) and a drafter q(. | prefix) given as
random tables (every prefix its own row, so p and q rows must be aligned by position), a
chain of K = 3 draft tokens drawn from q, and a tree of depth 2 (two children of the root, two
children each, siblings drawn without replacement from q). Each sample is one call of the real
`rejection_sample` / `recursive_rejection_sample` on a draft drawn with its exact probability,
its output continued with the target's own samples to K + 1 (chain) or 3 (tree) tokens. Exactly
(enumerating every draft and every accept/reject path), the algorithm's output so continued is
the target's joint over those tokens; a chi-square test compares the samples with that joint.

Mutants (tests/exact.py, `Bug`), each run through the same test in place of the verifier:
chain: (i) the recovered token drawn from p instead of norm(max(0, p - q)); (ii) drawn from p
renormalised over the residual's support {p > q} (a residual that is merely left unnormalised
is no mutant for the chain: `sample` normalises, and draws the very same tokens, shown below);
(iii) the bonus token from p_{K-1} instead of p_K; (iv) draft token i tested against
q_{i-1} (q off by one position). Tree: (i) as the chain's; (ii) the residual not renormalised
before the next sibling is tested against it (observable here: the test is u q(x) < target(x));
(iii) an accepted leaf's bonus from its parent's row; (v) every sibling tested against p
instead of the residual left by the siblings before it.

Statistics (asymptotic chi-square, cells with expected count below 5 pooled): each check on
the real verifiers fails by chance with probability ALPHA = 1e-4. A mutant's power, the
probability that its p-value falls below ALPHA, is computed from its exact distribution
(noncentral chi-square, lambda = n * its chi-square divergence from the target over the
cells; `test_the_stated_powers_hold` recomputes every figure). With CHAIN_SAMPLES = 10,000 and
TREE_SAMPLES = 6,000 (of 4,000, 6,000 and 10,000 the smallest at which every mutant escapes with
probability below 1e-8; at 4,000 chain (ii) escapes with 0.06, tree (v) with 2e-5):

| mutant | exact TV | P(escape) |      | mutant | exact TV | P(escape) |
|---|--:|--:|---|---|--:|--:|
| chain (i) p | 0.156 | < 1e-15 | | tree (i) p | 0.139 | < 1e-15 |
| chain (ii) support | 0.050 | 6.0e-9 | | tree (ii) unnormalised | 0.221 | < 1e-15 |
| chain (iii) bonus row | 0.018 | < 1e-15 | | tree (iii) bonus row | 0.557 | < 1e-15 |
| chain (iv) q off by one | 0.191 | < 1e-15 | | tree (v) siblings vs p | 0.059 | 1.5e-10 |

So this module fails falsely with probability at most 2 * ALPHA + 8 * 6.0e-9 < 2.1e-4 (the two
checks of the real verifiers, and a mutant escaping). The exact identities (algorithm ==
target joint, the copies with no bug == the real functions) are deterministic.
"""

import itertools
from functools import cache

import pytest
import torch
from exact import (
    Bug,
    chain_mutant,
    chi_square_power,
    chi_square_pvalue,
    sample_step,
    step_distribution,
    target_joint,
    tree_mutant,
    tree_shape,
    tv,
)

from forerun.sampling import sample
from forerun.tree import TokenTree
from forerun.verify import recursive_rejection_sample, rejection_sample

pytestmark = pytest.mark.usefixtures("one_thread")
V, ALPHA = 3, 1e-4
CHAIN, TREE = tree_shape((1, 1, 1)), tree_shape((2, 2))
CHAIN_LENGTH, TREE_LENGTH = 4, 3  # tokens compared: K + 1 for the chain, depth + 1 for the tree
CHAIN_SAMPLES, TREE_SAMPLES = 10_000, 6_000
TABLE_SEED, TABLE_SCALE = 1, 2.0  # logits ~ N(0, 2^2): rows far from uniform and from each other
MUTANTS = {  # name -> (bug, tree?, stated P(escape) at the sample size above)
    "chain-(i)-recovered-from-p": (Bug(recovered="p"), False, 1e-15),
    "chain-(ii)-recovered-over-the-support": (Bug(recovered="support"), False, 6.1e-9),
    "chain-(iii)-bonus-from-the-row-before": (Bug(bonus_from_parent=True), False, 1e-15),
    "chain-(iv)-q-off-by-one": (Bug(q_from_previous=True), False, 1e-15),
    "tree-(i)-recovered-from-p": (Bug(recovered="p"), True, 1e-15),
    "tree-(ii)-residual-unnormalised": (Bug(unnormalised=True), True, 1e-15),
    "tree-(iii)-bonus-from-the-parent-row": (Bug(bonus_from_parent=True), True, 1e-15),
    "tree-(v)-siblings-tested-against-p": (Bug(siblings_vs_p=True), True, 1.6e-10),
}


@cache
def table(seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    """A distribution over V tokens for every prefix of up to CHAIN_LENGTH tokens."""
    g, rows = torch.Generator().manual_seed(seed), {}
    for n in range(CHAIN_LENGTH + 1):
        for prefix in itertools.product(range(V), repeat=n):
            rows[prefix] = (torch.randn(V, generator=g, dtype=torch.float64)
                            * TABLE_SCALE).softmax(-1)
    return rows


def p_of(prefix):
    return table(TABLE_SEED)[prefix]


def q_of(prefix):
    return table(TABLE_SEED + 1000)[prefix]


def setting(is_tree: bool):
    """(tree, tokens compared, samples, real verifier) of the chain or the tree check."""
    if is_tree:
        return TREE, TREE_LENGTH, TREE_SAMPLES, recursive_rejection_sample
    return CHAIN, CHAIN_LENGTH, CHAIN_SAMPLES, rejection_sample


@pytest.mark.parametrize("is_tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["q", "q=None"])
def test_the_algorithm_s_exact_step_is_the_target_joint(is_tree, deterministic):
    """Losslessness, exactly: over every draft and every accept/reject path, one verify step
    continued with the target's samples is the target's joint (also for a drafter that
    chose its tokens, q = None); and every mutant parts from it."""
    tree, length, _, _ = setting(is_tree)
    joint = target_joint(p_of, length)
    assert tv(step_distribution(tree, p_of, q_of, length, Bug(), deterministic), joint) < 1e-12
    for bug, on_tree, _ in MUTANTS.values():
        if on_tree == is_tree and not deterministic:
            assert tv(step_distribution(tree, p_of, q_of, length, bug), joint) > 0.01


@pytest.mark.parametrize("is_tree", [False, True], ids=["chain", "tree"])
def test_the_verifier_s_samples_match_the_target_joint(is_tree):
    """Fails by chance with probability ALPHA."""
    tree, length, n, verifier = setting(is_tree)
    counts = sample_step(verifier, tree, p_of, q_of, length, n, seed=1)
    assert chi_square_pvalue(target_joint(p_of, length), counts) > ALPHA


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_mutant_fails_the_same_test(name):
    """The check above with a mutant in place of the verifier: its p-value must fall below
    ALPHA; it does not with the probability stated in MUTANTS (the module's table)."""
    bug, is_tree, _ = MUTANTS[name]
    tree, length, n, _ = setting(is_tree)
    verifier = tree_mutant(bug) if is_tree else chain_mutant(bug)
    counts = sample_step(verifier, tree, p_of, q_of, length, n, seed=1)
    assert chi_square_pvalue(target_joint(p_of, length), counts) < ALPHA


def test_the_stated_powers_hold():
    """Each mutant's exact distribution gives its P(escape) at the sample size used, at most
    the figure stated (deterministic: the docstring's table is computed, not guessed)."""
    for bug, is_tree, stated in MUTANTS.values():
        tree, length, n, _ = setting(is_tree)
        joint = target_joint(p_of, length)
        actual = step_distribution(tree, p_of, q_of, length, bug)
        assert 1 - chi_square_power(joint, actual, n, ALPHA) <= stated, bug


def test_the_mutant_copies_with_no_bug_are_the_real_verifiers():
    """The tree mutant is a copy of recursive_rejection_sample: with no bug it draws the same
    uniforms in the same order and returns the same verdicts; the chain mutants wrap the real
    rejection_sample itself."""
    g = torch.Generator().manual_seed(5)
    copy_tree, copy_chain = tree_mutant(Bug()), chain_mutant(Bug())
    for trial in range(200):
        n = int(torch.randint(1, 8, (), generator=g))
        parents = tuple(int(torch.randint(-1, i, (), generator=g)) for i in range(n))
        tree = TokenTree(parents)
        p = torch.rand(n + 1, V + 2, generator=g, dtype=torch.float64).softmax(-1) ** 3
        p = p / p.sum(-1, keepdim=True)
        q = torch.rand(n, V + 2, generator=g, dtype=torch.float64).softmax(-1)
        tokens = torch.randint(0, V + 2, (n,), generator=g)
        q_or_none = q if trial % 2 else None
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        assert copy_tree(tree, tokens, p, q_or_none, a) == recursive_rejection_sample(
            tree, tokens, p, q_or_none, b)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        assert copy_chain(tokens, p, q_or_none, a) == rejection_sample(tokens, p, q_or_none, b)


def test_an_unnormalised_chain_residual_draws_the_same_tokens():
    """Why 'a missing renormalisation of the residual' is no chain mutant: `sample` draws by
    inverse CDF scaled by the row's total, so max(0, p - q) and its normalisation give the
    same token for the same uniform (the tree's acceptance test is where it matters)."""
    g = torch.Generator().manual_seed(0)
    for seed in range(500):
        p, q = torch.rand(2, 6, generator=g, dtype=torch.float64).softmax(-1)
        residual = (p - q).clamp_min(0)
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert int(sample(residual, a)) == int(sample(residual / residual.sum(), b))
