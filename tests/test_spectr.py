"""SpecTr's k-sequential selection (forerun.verify_spectr), exactly and by sampling, beside
recursive rejection sampling on the same drafts.

The setting (as tests/test_verify_power.py's): a 3-token vocabulary, target p(. | prefix) and
drafter q(. | prefix) random tables; trees whose every node's children are i.i.d. draws from
q(. | path) (tests/exact_multi.py's `iid_drafts`): three candidates at the root, each with a
chain of one more token ((3, 1): SpecTr's three draft sequences of two tokens), and two
candidates of two candidates ((2, 2)). Exactly, one verify step of SpecTr continued with the
target's samples is the target's joint (to 1e-12); so is recursive rejection sampling's on the
same drafts; so is K-SEQ with rho = k (any rho in [rho*, k] is valid: losslessness does not
hang on the bisection). Mutants: (a) rho = 1 at every k (the residual would go negative; it
is clamped), (b) the recovered token drawn from p instead of p_res.

Statistics: the chi-square check of the real `spectr_sample` (SAMPLES = 6,000 verify steps on
(3, 1)) fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square; p-value seen
0.22). Each mutant's power at that size, from its exact distribution, is stated in MUTANTS and
recomputed by `test_the_stated_powers_hold`: exact TV 0.210 (rho = 1) and 0.141 (recovered
from p); each escapes with probability < 1e-15. Module false-failure rate: ALPHA + 2e-15.

Side by side (exact expectations by enumeration; the tokens a verify pass emits, accepted + 1,
at the same node budget: the same drafts under both verifiers; `wo`: recursive rejection on
the same shape with siblings drawn without replacement, the best of the three where the
vocabulary is this small):

| tree (nodes) | SpecTr | recursive rejection | rrs, without replacement |
|---|--:|--:|--:|
| (1,) (1) | 1.4706 | 1.4706 | 1.4706 |
| (2,) (2) | 1.6039 | 1.5827 | 1.8329 |
| (3,) (3) | 1.7053 | 1.6711 | 2.0000 |
| (2, 1) (4) | 1.8535 | 1.8288 | 2.1213 |
| (3, 1) (6) | 1.9719 | 1.9320 | 2.3985 |
| (2, 2) (6) | 1.9054 | 1.8795 | 2.6570 |

And at one position over a wider vocabulary (V = 6, `WIDE`: P(a candidate is accepted)):

| k | SpecTr | recursive rejection | bound sum min(p, 1 - (1 - q)^k) |
|--:|--:|--:|--:|
| 1 | 0.3297 | 0.3297 | 0.3297 |
| 2 | 0.4693 | 0.4581 | 0.5023 |
| 3 | 0.5607 | 0.5465 | 0.5986 |

Properties checked on every row: both verifiers exact; both accept at least what one candidate
does and at most the bound (no verifier of i.i.d. candidates can accept x more often than x is
drawn, 1 - (1 - q(x))^k, or than p(x)); SpecTr within its guarantee, at least (1 - 1/e) of the
bound; and the stated figures themselves (to 1e-4).
"""

import itertools
import math
from functools import cache

import pytest
import torch
from exact import chi_square_power, chi_square_pvalue, drafts, extend, target_joint, tree_shape, tv
from exact_multi import (
    SpecBug,
    expected_tokens,
    iid_drafts,
    rrs,
    spectr_mutant,
    spectr_verdicts,
    step_distribution,
)

from forerun.sampling import sample
from forerun.tree import TokenTree
from forerun.verify import recursive_rejection_sample
from forerun.verify_spectr import (
    TREE_VERIFIERS,
    acceptance,
    beta,
    k_sequential,
    optimal_rho,
    residual,
    spectr_sample,
)

pytestmark = pytest.mark.usefixtures("one_thread")
V, ALPHA, SAMPLES = 3, 1e-4, 6_000
TABLE_SEED, TABLE_SCALE, DEPTH = 1, 2.0, 3
SEQUENCES, SQUARE = tree_shape((3, 1)), tree_shape((2, 2))
MUTANTS = {  # name -> (bug, stated P(escape) at SAMPLES on SEQUENCES)
    "rho-one": (SpecBug(rho="one"), 1e-15),
    "recovered-from-p": (SpecBug(recovered="p"), 1e-15),
}
# tree shape -> (SpecTr, recursive rejection, rrs without replacement): tokens per pass
SIDE_BY_SIDE = {
    (1,): (1.4706, 1.4706, 1.4706),
    (2,): (1.6039, 1.5827, 1.8329),
    (3,): (1.7053, 1.6711, 2.0000),
    (2, 1): (1.8535, 1.8288, 2.1213),
    (3, 1): (1.9719, 1.9320, 2.3985),
    (2, 2): (1.9054, 1.8795, 2.6570),
}
WIDE_V, WIDE_SEED = 6, 7
WIDE = {1: (0.3297, 0.3297, 0.3297), 2: (0.4693, 0.4581, 0.5023), 3: (0.5607, 0.5465, 0.5986)}
STATED = 1e-4  # the tables' figures hold to this


@cache
def table(seed: int, vocab: int = V) -> dict[tuple[int, ...], torch.Tensor]:
    """A distribution over `vocab` tokens for every prefix of up to DEPTH tokens."""
    g, rows = torch.Generator().manual_seed(seed), {}
    for n in range(DEPTH + 1):
        for prefix in itertools.product(range(vocab), repeat=n):
            rows[prefix] = (torch.randn(vocab, generator=g, dtype=torch.float64)
                            * TABLE_SCALE).softmax(-1)
    return rows


def p_of(prefix):
    return table(TABLE_SEED)[prefix]


def q_of(prefix):
    return table(TABLE_SEED + 1000)[prefix]


def spectr_with(bug: SpecBug):
    return lambda tree, tokens, p, q: spectr_verdicts(tree, tokens, p, q, bug)


def one_step(tree: TokenTree, verdicts) -> dict:
    """The exact output of one verify step on i.i.d. drafts, continued to depth + 1 tokens."""
    length = max(tree.depth) + 1
    return extend(step_distribution(iid_drafts(tree, p_of, q_of), tree, verdicts), p_of, length)


@pytest.mark.parametrize("tree", [SEQUENCES, SQUARE], ids=["3-sequences", "2x2"])
def test_one_exact_step_is_the_target_joint(tree):
    """Losslessness, exactly: SpecTr (rho* and rho = k) and recursive rejection on the same
    i.i.d. drafts each give the target's joint; each mutant parts from it."""
    joint = target_joint(p_of, max(tree.depth) + 1)
    assert tv(one_step(tree, spectr_with(SpecBug())), joint) < 1e-12
    assert tv(one_step(tree, spectr_with(SpecBug(rho="k"))), joint) < 1e-12
    assert tv(one_step(tree, rrs), joint) < 1e-12
    for bug, _ in MUTANTS.values():
        assert tv(one_step(tree, spectr_with(bug)), joint) > 0.1


def sample_iid(verifier, tree: TokenTree, n: int, seed: int) -> dict[tuple[int, ...], int]:
    """n verify steps of `verifier` on i.i.d. drafts drawn with their exact probabilities,
    each continued with the target's samples to depth + 1 tokens -> counts."""
    import random

    cases = iid_drafts(tree, p_of, q_of)
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    length, counts = max(tree.depth) + 1, {}
    for i in rng.choices(range(len(cases)), [c.probability for c in cases], k=n):
        case = cases[i]
        seq = tuple(verifier(tree, case.tokens, case.p, case.q, generator).tokens)
        while len(seq) < length:
            seq += (int(sample(p_of(seq), generator)),)
        counts[seq[:length]] = counts.get(seq[:length], 0) + 1
    return counts


def test_spectr_s_samples_match_the_target_joint():
    """Fails by chance with probability ALPHA."""
    counts = sample_iid(spectr_sample, SEQUENCES, SAMPLES, seed=1)
    assert chi_square_pvalue(target_joint(p_of, 3), counts) > ALPHA


@pytest.mark.parametrize("name", list(MUTANTS))
def test_each_mutant_fails_the_same_test(name):
    """Its p-value must fall below ALPHA; it does not with the probability stated in MUTANTS."""
    bug, _ = MUTANTS[name]
    counts = sample_iid(spectr_mutant(bug), SEQUENCES, SAMPLES, seed=1)
    assert chi_square_pvalue(target_joint(p_of, 3), counts) < ALPHA


def test_the_stated_powers_hold():
    joint = target_joint(p_of, 3)
    for bug, stated in MUTANTS.values():
        actual = one_step(SEQUENCES, spectr_with(bug))
        assert 1 - chi_square_power(joint, actual, SAMPLES, ALPHA) <= stated, bug


def random_iid_tree(g: torch.Generator, vocab: int):
    """A random tree, its tokens, p rows and q rows where siblings share their parent's q."""
    n = int(torch.randint(1, 8, (), generator=g))
    tree = TokenTree(tuple(int(torch.randint(-1, i, (), generator=g)) for i in range(n)))
    p = torch.rand(n + 1, vocab, generator=g, dtype=torch.float64).softmax(-1) ** 3
    p = p / p.sum(-1, keepdim=True)
    q_parent = torch.rand(n + 1, vocab, generator=g, dtype=torch.float64).softmax(-1)  # per row
    q = q_parent[[parent + 1 for parent in tree.parents]]  # [N, V]: a child's = its parent's
    tokens = torch.multinomial(q, 1, generator=g).flatten()
    return tree, tokens, p, q


def test_the_mutant_copy_with_no_bug_is_the_real_verifier():
    """spectr_mutant(SpecBug()) draws the same uniforms in the same order and returns the same
    verdicts as spectr_sample (so the mutants differ from it by their bug alone)."""
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        tree, tokens, p, q = random_iid_tree(g, V + 2)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        assert spectr_mutant(SpecBug())(tree, tokens, p, q, a) == spectr_sample(tree, tokens, p,
                                                                                q, b)


def test_one_candidate_is_rejection_sampling():
    """k = 1: rho* = 1 and p_res = norm(max(0, p - q)): on a chain SpecTr returns what
    recursive rejection sampling returns, uniform for uniform."""
    g = torch.Generator().manual_seed(4)
    for trial in range(200):
        n = int(torch.randint(1, 6, (), generator=g))
        p = torch.rand(n + 1, 5, generator=g, dtype=torch.float64).softmax(-1) ** 2
        p = p / p.sum(-1, keepdim=True)
        q = torch.rand(n, 5, generator=g, dtype=torch.float64).softmax(-1)
        tokens = torch.multinomial(q, 1, generator=g).flatten()
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        chain = TokenTree.chain(n)
        assert spectr_sample(chain, tokens, p, q, a) == recursive_rejection_sample(
            chain, tokens, p, q, b)


def test_rho_star_is_the_least_valid_rho():
    """optimal_rho returns a rho in [1, k] where p_res >= 0 (p_acc <= rho beta), and nothing
    much below it is valid; the residual then sums to one and is never negative."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        vocab, k = int(torch.randint(2, 40, (), generator=g)), int(torch.randint(1, 6, (),
                                                                               generator=g))
        p = (torch.randn(vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
        q = (torch.randn(vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
        if trial % 3 == 0:  # q with holes where p has mass (top-k drafts)
            q[: vocab // 2] = 0
            q = q / q.sum()
        rho = optimal_rho(p, q, k)
        b = beta(p, q, rho)
        assert 1 <= rho <= k and acceptance(b, k) <= rho * b + 1e-14
        if rho > 1:
            lower = beta(p, q, rho - 1e-8)
            assert acceptance(lower, k) > (rho - 1e-8) * lower - 1e-12
        accepted = torch.minimum(q, p / rho) * acceptance(b, k) / b  # [V]
        assert float((p - accepted).min()) > -1e-12
        res = residual(p, q, rho, k)
        assert abs(float(res.sum()) - 1) < 1e-12 and float(res.min()) >= 0


def test_k_sequential_accepts_the_first_candidate_it_can():
    """A candidate with p >= rho q is accepted whatever the uniform (the first such one)."""
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.4, 0.4], dtype=torch.float64)
    assert optimal_rho(p, q, 2) * 0.2 <= 0.7
    for seed in range(20):
        assert k_sequential([0, 1], p, q, torch.Generator().manual_seed(seed)) == (0, 0)


def test_siblings_from_different_q_are_refused_and_chosen_ones_go_to_rrs():
    tree = tree_shape((2,))
    p = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"i\.i\.d\."):
        spectr_sample(tree, torch.tensor([0, 1]), p, q, torch.Generator().manual_seed(0))
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert spectr_sample(tree, torch.tensor([0, 1]), p, None, a) == \
        recursive_rejection_sample(tree, torch.tensor([0, 1]), p, None, b)
    assert set(TREE_VERIFIERS) == {"rrs", "spectr"}


@pytest.mark.parametrize("shape", list(SIDE_BY_SIDE), ids=str)
def test_side_by_side_at_equal_node_budgets(shape):
    """Both verifiers exact on the same drafts; the tokens per pass stated in the module's
    table; SpecTr's root acceptance within its (1 - 1/e) guarantee of the i.i.d. bound."""
    tree = tree_shape(shape)
    cases = iid_drafts(tree, p_of, q_of)
    length, joint = len(shape) + 1, target_joint(p_of, len(shape) + 1)
    spectr = step_distribution(cases, tree, spectr_with(SpecBug()))
    recursive = step_distribution(cases, tree, rrs)
    without = step_distribution(drafts(tree, p_of, q_of), tree, rrs)
    for emitted in (spectr, recursive, without):
        assert tv(extend(emitted, p_of, length), joint) < 1e-12
    figures = tuple(expected_tokens(e) for e in (spectr, recursive, without))
    assert figures == pytest.approx(SIDE_BY_SIDE[shape], abs=STATED)
    one = expected_tokens(step_distribution(iid_drafts(tree_shape((1,) * len(shape)), p_of,
                                                       q_of), tree_shape((1,) * len(shape)), rrs))
    assert min(figures[:2]) >= one - 1e-12  # more candidates never accept less than one


@cache
def wide(seed: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    p = {(): (torch.randn(WIDE_V, generator=g, dtype=torch.float64) * TABLE_SCALE).softmax(-1)}
    q = (torch.randn(WIDE_V, generator=g, dtype=torch.float64) * TABLE_SCALE).softmax(-1)
    for x in range(WIDE_V):
        p[(x,)] = (torch.randn(WIDE_V, generator=g, dtype=torch.float64)
                   * TABLE_SCALE).softmax(-1)
    return q, p


@pytest.mark.parametrize("k", list(WIDE))
def test_one_position_over_a_wider_vocabulary(k):
    """P(accept) at the root with k i.i.d. candidates: SpecTr's closed form 1 - (1 - beta)^k
    equals its enumeration; both verifiers between one candidate's and the bound; SpecTr at
    least (1 - 1/e) of the bound; the figures stated in the module's table."""
    q, p = wide(WIDE_SEED)
    tree = tree_shape((k,))
    cases = iid_drafts(tree, lambda prefix: p[prefix], lambda prefix: q)
    spectr = expected_tokens(step_distribution(cases, tree, spectr_with(SpecBug()))) - 1
    recursive = expected_tokens(step_distribution(cases, tree, rrs)) - 1
    root_p = p[()]
    bound = float(torch.minimum(root_p, 1 - (1 - q) ** k).sum())
    one = float(torch.minimum(root_p, q).sum())
    assert spectr == pytest.approx(acceptance(beta(root_p, q, optimal_rho(root_p, q, k)), k),
                                   abs=1e-12)
    for figure in (spectr, recursive):
        assert one - 1e-12 <= figure <= bound + 1e-12
    assert spectr >= (1 - 1 / math.e) * bound
    assert (spectr, recursive, bound) == pytest.approx(WIDE[k], abs=STATED)
