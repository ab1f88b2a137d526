"""Multi-draft speculation (forerun.propose.multi): several drafters' drafts merged into one
tree, verified in one pass, losslessly, with greedy output equal to plain decoding's.

One step, exactly (3-token tables as tests/test_verify_power.py's): a chosen chain (n-gram
like, q = None), draft-model chains sampled from q, and a second sampling drafter, merged by
the real `join`; every merged draft with its probability, every verdict of recursive
rejection sampling: the step continued with the target's samples is the target's joint (to
1e-12), in every mix and order. The mutant `merge_unrenormalised` (a merged node keeps its
drafter's q instead of q renormalised over what its earlier siblings took) parts from it;
treating the whole merged tree as chosen (q = None, the safe fallback) is exact too, and
accepts less (figures in `test_sampled_first_accepts_more_than_each_alone`).

The engine (TableModel target and draft, tests/exact.py; the real speculative_decode loop):
`multi` with draft + ngram (K = 3), draft + draft + ngram (K = 2, merged: rrs; on sharper
tables) and three draft chains verified by SpecTr (K = 2, kept apart), RUNS seeded generations
each, most of whose steps verify a branching tree, a chi-square test against the target's
exact joint of NEW tokens (p-values seen: 0.53, 0.17, 0.47). The engine's exact output distribution
(`engine_joint`: every sub-draft, the real join, every verdict, every later step) is the
target's joint to 1e-12 for each. Mutants in the engine: the unrenormalised merge under draft
+ draft + ngram, and SpecTr with rho = 1 under the three chains; each must fail, with the
escape probability stated in MUTANTS, recomputed from its exact distribution (exact TV 0.051
for the merge on the sharp tables, 6,000 runs: escapes with 8.6e-9; 0.150 for rho = 1, 2,000
runs: 2.2e-15).

Batched (tiny float64 transformers over the same 3 tokens): one batch a run of three multi
members (draft + ngram, three chains under SpecTr, ngram + two chains) whose draft-model chains
all come from one shared draft model (`MultiDrafter`'s rounds), BATCHED_RUNS runs, each member
against the target's exact joint (p-values seen: 0.63, 0.68, 0.34).

False failures: each of the 6 engine checks fails by chance with probability ALPHA = 1e-4
(asymptotic chi-square), each mutant check with its stated escape probability (<= 1e-8).
Module total: 6e-4 + 2e-8 < 7e-4. Greedy equality and the exact identities are deterministic.

Greedy (tiny float64 transformers, conftest): `multi` alone (draft + ngram; three draft chains
under spectr, which merge into one chain when nothing is sampled; ngram + two draft chains; an
EAGLE head's tree + draft + ngram, the head fed the target's features through `multi`), as
members of a mixed batch, in a batched session with the batch's shared draft model (beside
plain and draft members) and through the server's worker, equals plain greedy decoding token
for token; a seeded sampled member gives the same tokens alone and in a batch. The k chains
draw their roots from one q row, bit for bit, and every later token from the draft's row after
its own path, alone and batched. Real weights (SmolLM2-135M in bfloat16, torch): SpecTr over
three draft chains runs, alone and batched (it raised before the shared root row).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from functools import cache

import pytest
import torch
from conftest import random_heads, tiny_model, tiny_runtime
from exact import (
    TableModel,
    TableRuntime,
    chi_square_power,
    chi_square_pvalue,
    drafts,
    extend,
    target_joint,
    tv,
    verdict_distribution,
)
from exact_multi import (
    SpecBug,
    expected_tokens,
    merge_unrenormalised,
    spectr_mutant,
    spectr_verdicts,
)
from test_lossless_deep import rows as deep_rows

import forerun.propose.multi as multi
from forerun import Engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.batch_session import BatchSession
from forerun.engine import speculative_decode
from forerun.policy import POLICIES, FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import Draft, DraftRequest
from forerun.propose.draft_batch import SHARED_DRAFT, SharedDraftModel
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.multi import (
    MULTI_DRAFTER,
    MultiConfig,
    MultiProposer,
    join,
    merge,
    side_by_side,
)
from forerun.propose.ngram import NgramProposer
from forerun.reference import plain_decode
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.tree import TokenTree
from forerun.verify_spectr import TREE_VERIFIERS

pytestmark = pytest.mark.usefixtures("one_thread")
V, ALPHA, RUNS = 3, 1e-4, 2000

# --- one step, exactly ----------------------------------------------------------------------

TABLE_SCALE, DEPTH, CHAIN = 2.0, 3, 2


@cache
def table(seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    g, rows = torch.Generator().manual_seed(seed), {}
    for n in range(DEPTH + 1):
        for prefix in itertools.product(range(V), repeat=n):
            rows[prefix] = (torch.randn(V, generator=g, dtype=torch.float64)
                            * TABLE_SCALE).softmax(-1)
    return rows


def tables(seed: int):
    """(p, q, another sampler's q, a chooser's scores) as functions of the prefix."""
    return tuple((lambda t: lambda prefix: t[prefix])(table(seed + 1000 * i)) for i in range(4))


def sampled(q_of, p_of) -> list[tuple[float, Draft]]:
    """Every CHAIN-token draft sampled from q_of, with its probability."""
    return [(c.probability, Draft(c.tokens, c.q)) for c in drafts(TokenTree.chain(CHAIN), p_of,
                                                                  q_of)]


def chosen(score_of) -> list[tuple[float, Draft]]:
    """The chain a deterministic drafter picks: its scores' argmax along its own path."""
    tokens, prefix = [], ()
    for _ in range(CHAIN):
        tokens.append(int(score_of(prefix).argmax()))
        prefix += (tokens[-1],)
    return [(1.0, Draft(torch.tensor(tokens)))]


def step(p_of, options: list[list[tuple[float, Draft]]], joined, none_q: bool = False,
         verdicts=verdict_distribution):
    """The exact tokens one verify step emits over every combination of the sub-drafts
    (`verdicts`: a verifier's exact distribution for one draft; recursive rejection's)."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    for combo in itertools.product(*options):
        prob = float(torch.tensor([pr for pr, _ in combo], dtype=torch.float64).prod())
        d = joined([x for _, x in combo])
        tree = TokenTree.of(d.parents, len(d.tokens))
        p = torch.stack([p_of(())] + [p_of(tuple(int(d.tokens[j]) for j in tree.path(i)))
                                      for i in range(len(tree))])
        for seq, pr in verdicts(tree, d.tokens, p, None if none_q else d.q).items():
            out[seq] += prob * pr
    return out


def merged(ds):
    return join(ds, merges=True)


def unrenormalised(ds):
    return merge_unrenormalised(sorted(ds, key=lambda d: d.q is None))


MIXES = {  # name -> (which sub-drafts, in the configured order; the mutant's exact TV)
    "draft+ngram": (("draft", "ngram"), 0.0),  # one sampled draft, first: nothing to renormalise
    "ngram+draft": (("ngram", "draft"), 0.0),  # join puts the sampled draft first all the same
    "draft+draft": (("draft", "draft"), 0.0372),
    "draft+other+ngram": (("draft", "other", "ngram"), 0.0020),
}


def options_for(mix, seed: int = 1):
    p_of, q_of, r_of, c_of = tables(seed)
    make = {"draft": lambda: sampled(q_of, p_of), "other": lambda: sampled(r_of, p_of),
            "ngram": lambda: chosen(c_of)}
    return p_of, [make[m]() for m in mix]


@pytest.mark.parametrize("name", list(MIXES))
def test_one_merged_step_is_the_target_joint(name):
    """Exact, over every sub-draft and verdict: the merged tree with renormalised q, and the
    same tree verified as chosen (q = None); the unrenormalised mutant parts from it wherever
    two sampled drafts share a node's children."""
    mix, mutant_tv = MIXES[name]
    p_of, options = options_for(mix)
    joint = target_joint(p_of, CHAIN + 1)
    assert tv(extend(step(p_of, options, merged), p_of, CHAIN + 1), joint) < 1e-12
    assert tv(extend(step(p_of, options, merged, none_q=True), p_of, CHAIN + 1), joint) < 1e-12
    mutant = tv(extend(step(p_of, options, unrenormalised), p_of, CHAIN + 1), joint)
    assert mutant == pytest.approx(mutant_tv, abs=1e-4)


# seed -> tokens per pass (draft then ngram merged; ngram then draft merged, i.e. without
# join's order; the merged tree verified as chosen; draft alone; ngram alone)
ORDERS = {
    0: (1.8091, 1.7731, 1.7686, 1.6808, 1.1649),
    1: (2.3930, 2.3584, 2.3382, 1.1219, 2.2713),
    2: (2.1298, 2.1166, 1.7994, 2.0729, 1.0669),
    3: (1.1517, 1.1468, 1.1363, 1.1480, 1.0731),
    4: (2.0033, 1.7629, 1.6130, 1.8935, 1.2787),
    5: (2.0721, 1.9888, 1.9699, 1.3057, 1.8773),
}


@pytest.mark.parametrize("seed", list(ORDERS))
def test_sampled_first_accepts_more_than_each_alone(seed):
    """Tokens per pass, exactly: the sampled draft first (join's order) accepts at least what
    either draft does alone; the chosen one first can fall below the sampled draft alone
    (seed 4); the merged tree verified as chosen (q = None) accepts less than with its q."""
    p_of, q_of, _, c_of = tables(10 + seed)
    draft, ngram = sampled(q_of, p_of), chosen(c_of)
    figures = (
        expected_tokens(step(p_of, [draft, ngram], multi.merge)),
        expected_tokens(step(p_of, [ngram, draft], multi.merge)),
        expected_tokens(step(p_of, [draft, ngram], multi.merge, none_q=True)),
        expected_tokens(step(p_of, [draft], merged)),
        expected_tokens(step(p_of, [ngram], merged)),
    )
    assert figures == pytest.approx(ORDERS[seed], abs=1e-4)
    assert figures[0] >= max(figures[3], figures[4]) - 1e-12
    assert figures[0] >= figures[2] - 1e-12


# (seed, k chains of 2) -> tokens per pass: SpecTr over the chains kept apart (2k nodes),
# recursive rejection over the same trees, recursive rejection merged (join's trie); and the
# merged trie's expected node count
CHAINS = {
    (1, 2): (1.8535, 1.8288, 1.8241, 2.9463),
    (1, 3): (1.9719, 1.9320, 1.9109, 3.5184),
    (14, 2): (2.1808, 2.1500, 2.0997, 3.3108),
    (14, 3): (2.3017, 2.2750, 2.2307, 4.2365),
}


def spectr_or_rrs(tree, tokens, p, q):
    return spectr_verdicts(tree, tokens, p, q) if q is not None and not tree.is_chain else \
        verdict_distribution(tree, tokens, p, q)


@pytest.mark.parametrize(("seed", "k"), list(CHAINS))
def test_k_draft_chains_side_by_side(seed, k):
    """k i.i.d. draft chains of two tokens, exactly: kept apart (2k nodes) SpecTr and recursive
    rejection are both exact, SpecTr ahead; merged into a trie (fewer nodes: duplicates share
    one) recursive rejection stays exact with about the same tokens a pass; all above one
    chain. The figures are CHAINS'."""
    p_of, q_of, _, _ = tables(seed)
    options = [sampled(q_of, p_of)] * k
    joint = target_joint(p_of, CHAIN + 1)
    nodes = sum(float(torch.tensor([pr for pr, _ in combo], dtype=torch.float64).prod())
                * len(join([d for _, d in combo], merges=True).tokens)
                for combo in itertools.product(*options))
    runs = (step(p_of, options, lambda ds: join(ds, merges=False), verdicts=spectr_or_rrs),
            step(p_of, options, lambda ds: join(ds, merges=False)), step(p_of, options, merged))
    for emitted in runs:
        assert tv(extend(emitted, p_of, CHAIN + 1), joint) < 1e-12
    figures = (*(expected_tokens(e) for e in runs), nodes)
    assert figures == pytest.approx(CHAINS[(seed, k)], abs=1e-4)
    one = expected_tokens(step(p_of, options[:1], merged))
    assert figures[0] > figures[1] > one


def test_merge_makes_a_trie_and_side_by_side_keeps_drafts_apart():
    a = Draft(torch.tensor([1, 2, 0]), None)
    b = Draft(torch.tensor([1, 0]), torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.25, 0.25]]))
    d = merge([b, a])
    assert d.tokens.tolist() == [1, 0, 2, 0] and d.parents.tolist() == [-1, 0, 0, 2]
    assert d.q[2].tolist() == [0.0, 0.0, 1.0]  # chosen: one-hot, unchanged
    assert d.q[1].tolist() == [0.5, 0.25, 0.25]  # sampled first: its own q
    d = merge([a, b])  # b's second token now comes after a's sibling 2: q without it
    assert d.tokens.tolist() == [1, 2, 0, 0] and d.parents.tolist() == [-1, 0, 1, 0]
    assert d.q[3].tolist() == pytest.approx([2 / 3, 1 / 3, 0.0])
    apart = side_by_side([b, b])
    assert apart.parents.tolist() == [-1, 0, -1, 2] and apart.q.shape == (4, 3)
    assert join([a, a], merges=False).parents.tolist() == [-1, 0, 1]  # chosen: merged anyway
    assert join([Draft.empty(), b], merges=True) is b  # a lone chain as it is


def test_bad_options_fail_clearly():
    with pytest.raises(ValueError, match="unknown methods"):
        SpecConfig("multi", multi_methods=("draft", "nope"))
    with pytest.raises(ValueError, match="one sampling method"):
        SpecConfig("multi", multi_methods=("draft", "ngram"), multi_verifier="spectr")
    with pytest.raises(ValueError, match="unknown verifier"):
        SpecConfig("multi", multi_verifier="best")
    with pytest.raises(ValueError, match="other methods"):
        SpecConfig("multi", multi_methods=("multi",))


# --- the engine, sampled ----------------------------------------------------------------------

PROMPT = [1, 2, 0, 1, 2, 0, 1]  # repeats: n-gram lookup drafts from the first step on
TEMPERATURE = SamplingConfig(temperature=1.0)
# (target, draft) tables: logits N(0, 1) per token, the draft's perturbed by N(0, 1); and a
# sharper pair, N(0, 3^2) perturbed by N(0, 3^2), where two draft chains often share a first
# token and part after it (where the unrenormalised merge shows: exact TV 0.051 there, 0.010
# on the mild pair)
MODELS = {"mild": (TableModel(V, seed=1), TableModel(V, seed=1, noise=1.0)),
          "sharp": (TableModel(V, seed=1, scale=3.0), TableModel(V, seed=1, scale=3.0,
                                                                 noise=3.0))}
ENGINE_CASES = {  # name -> (methods, verifier, K, NEW, models)
    "draft+ngram": (("draft", "ngram"), "rrs", 3, 5, "mild"),
    "draft+draft+ngram": (("draft", "draft", "ngram"), "rrs", 2, 4, "sharp"),
    "three-draft-chains-spectr": (("draft", "draft", "draft"), "spectr", 2, 4, "mild"),
}
MUTANTS = {  # name -> (engine case, what is broken, runs, stated P(escape) in those runs)
    "merge-unrenormalised": ("draft+draft+ngram", "merge", 6000, 1e-8),
    "spectr-rho-one": ("three-draft-chains-spectr", "rho", RUNS, 1e-14),
}


@cache
def rows(models: str, model: str):
    table_model = MODELS[models][model == "draft"]

    @cache
    def row(prefix: tuple[int, ...]) -> torch.Tensor:
        return logits_to_probs(table_model.logits((*PROMPT, *prefix)), TEMPERATURE)

    return row


class Shapes:
    """A proposer as it is, counting the trees it drafts: nodes, branching ones."""

    def __init__(self, inner):
        self.inner, self.counts = inner, Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        d = self.inner.propose(tokens, k, sampling, generator)
        tree = TokenTree.of(d.parents, len(d.tokens))
        self.counts.update(nodes=len(tree), trees=int(not tree.is_chain), steps=1)
        return d


def multi_proposer(methods, verifier, models: str) -> MultiProposer:
    """The method as its factory builds it: draft sub-proposers share one draft runtime."""
    draft = TableRuntime(MODELS[models][1])
    make = {"draft": lambda: DraftModelProposer(draft, V), "ngram": lambda: NgramProposer(1, 4)}
    return MultiProposer([make[m]() for m in methods], MultiConfig(methods, verifier))


def empirical(name, runs=RUNS, seed=2024):
    methods, verifier, K, new, models = ENGINE_CASES[name]
    proposer = Shapes(multi_proposer(methods, verifier, models))
    generator, counts = make_generator(seed), defaultdict(int)
    for _ in range(runs):
        steps = speculative_decode(TableRuntime(MODELS[models][0]), proposer, FixedK(K), PROMPT,
                                   TEMPERATURE, new, (), generator)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    return counts, proposer.counts


def engine_joint(name, broken: str | None = None) -> dict[tuple[int, ...], float]:
    """The exact distribution of the engine's NEW tokens: the prefill's from p, then each
    step's sub-drafts (every draft-model chain with its probability, the n-gram's
    continuation), the real join (or the broken merge), every verdict (recursive rejection,
    or SpecTr with or without the broken rho), recursively."""
    methods, verifier, K, new, models = ENGINE_CASES[name]
    p_of, q_of = rows(models, "target"), rows(models, "draft")
    bug = SpecBug(rho="one") if broken == "rho" else SpecBug()
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def sub_drafts(method, prefix, k):
        if method == "ngram":
            found = NgramProposer(1, 4).propose([*PROMPT, *prefix], k, TEMPERATURE, None)
            return [(1.0, found)]
        return [(c.probability, Draft(c.tokens, c.q))
                for c in drafts(TokenTree.chain(k), p_of, q_of, prefix)]

    def walk(prefix, prob):
        if len(prefix) >= new:
            out[prefix[:new]] += prob
            return
        k = min(K, new - len(prefix) - 1)
        options = [sub_drafts(m, prefix, k) for m in methods] if k else [[(1.0, Draft.empty())]]
        for combo in itertools.product(*options):
            pr = prob
            for x, _ in combo:
                pr *= x
            ds = [d for _, d in combo]
            d = (unrenormalised([x for x in ds if len(x.tokens)]) if broken == "merge"
                 and sum(len(x.tokens) > 0 for x in ds) > 1 else join(ds, verifier == "rrs"))
            tree = TokenTree.of(d.parents, len(d.tokens))
            p = torch.stack([p_of(prefix)] + [p_of(prefix + tuple(int(d.tokens[j]) for j in
                                                                  tree.path(i)))
                                              for i in range(len(tree))])
            spectr = verifier == "spectr" and d.q is not None and not tree.is_chain
            verdicts = (spectr_verdicts(tree, d.tokens, p, d.q, bug) if spectr else
                        verdict_distribution(tree, d.tokens, p, d.q))
            for seq, x in verdicts.items():
                walk(prefix + seq, pr * x)

    first = p_of(())
    for y in range(V):
        walk((y,), float(first[y]))
    return out


@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_the_engine_with_merged_drafts_matches_the_target_joint(name):
    """Fails by chance with probability ALPHA. Every run's first step drafts a tree (two or
    three K-deep sub-drafts, merged or kept apart); most of them branch."""
    _, _, K, new, models = ENGINE_CASES[name]
    counts, shapes = empirical(name)
    assert shapes["trees"] >= RUNS // 2 and shapes["nodes"] > RUNS * K * 1.5, shapes
    assert chi_square_pvalue(target_joint(rows(models, "target"), new), counts) > ALPHA


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_engine_with_a_broken_join_or_verifier_fails(name, monkeypatch):
    """Its p-value must fall below ALPHA (it does not with the probability in MUTANTS)."""
    case, broken, runs, _ = MUTANTS[name]
    if broken == "merge":
        monkeypatch.setattr(multi, "merge", merge_unrenormalised)
    else:
        monkeypatch.setitem(TREE_VERIFIERS, "spectr", spectr_mutant(SpecBug(rho="one")))
    counts, _ = empirical(case, runs)
    _, _, _, new, models = ENGINE_CASES[case]
    assert chi_square_pvalue(target_joint(rows(models, "target"), new), counts) < ALPHA


def test_the_engine_s_exact_output_and_the_stated_powers():
    """With the real join and verifiers the engine's exact output is the target's joint (every
    later step included); each mutant escapes with at most its stated probability."""
    for name, (_, _, _, new, models) in ENGINE_CASES.items():
        assert tv(engine_joint(name), target_joint(rows(models, "target"), new)) < 1e-12, name
    for case, broken, runs, stated in MUTANTS.values():
        _, _, _, new, models = ENGINE_CASES[case]
        joint = target_joint(rows(models, "target"), new)
        actual = engine_joint(case, broken)
        assert 1 - chi_square_power(joint, actual, runs, ALPHA) <= stated, case


# --- greedy: token for token plain decoding's -------------------------------------------------

GREEDY_PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [10, 20, 30, 40, 50, 60], [7, 7, 8]]
MULTI_SPECS = {
    "draft+ngram": SpecConfig("multi", 3, multi_methods=("draft", "ngram")),
    "three-chains-spectr": SpecConfig("multi", 3, multi_methods=("draft",) * 3,
                                      multi_verifier="spectr"),
    "ngram+draft+draft": SpecConfig("multi", 4, multi_methods=("ngram", "draft", "draft")),
    "eagle-tree+draft+ngram": SpecConfig("multi", 3, multi_methods=("eagle", "draft", "ngram"),
                                         tree=6, tree_topk=2),  # a head's tree, fed features
}


def _plain(prompt, n):
    steps = plain_decode(TorchRuntime(tiny_model(0), capacity=256), list(prompt),
                         SamplingConfig(), n, (), make_generator(0))
    return [t for s in steps for t in s.tokens]


def _proposer(spec: SpecConfig, draft_seed: int = 0):
    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(draft_seed, noise=0.3), capacity=256)
    heads = random_heads("eagle", target) if "eagle" in spec.multi_methods else None
    return target, PROPOSERS["multi"](spec, ProposerContext(target, draft, heads))


@pytest.mark.parametrize("name", list(MULTI_SPECS))
def test_greedy_multi_equals_plain_decoding(name):
    spec = MULTI_SPECS[name]
    for prompt in GREEDY_PROMPTS:
        target, proposer = _proposer(spec)
        shapes = Shapes(proposer)
        steps = list(speculative_decode(target, shapes, FixedK(spec.k), prompt, SamplingConfig(),
                                        30, (), make_generator(0)))
        assert [t for s in steps for t in s.tokens] == _plain(prompt, 30), prompt
        assert sum(s.drafted for s in steps) > 0
        # one method k times drafts k equal chains under greedy, merged into one
        assert (shapes.counts["trees"] == 0) == (len(set(spec.multi_methods)) == 1), prompt


def test_greedy_multi_members_of_a_mixed_batch_equal_plain_decoding():
    """Plain, ngram, draft and multi members in one batch (more than it holds at once): each
    member's tokens are its own plain greedy decoding's."""
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    members = [("none", 0, 25), ("multi-draft+ngram", 0, 30), ("ngram", 1, 20),
               ("multi-three-chains-spectr", 1, 28), ("draft", 2, 22),
               ("multi-ngram+draft+draft", 2, 26)]
    seqs = []
    for method, p, n in members:
        if method == "none":
            seqs.append(Sequence(list(GREEDY_PROMPTS[p]), SamplingConfig(), n, make_generator(0),
                                 ()))
            continue
        spec = MULTI_SPECS[method[6:]] if method.startswith("multi-") else SpecConfig(method, 3)
        target = TorchRuntime(tiny_model(0), capacity=256)
        draft = TorchRuntime(tiny_model(0, noise=0.3), capacity=256)
        proposer = PROPOSERS[spec.method](spec, ProposerContext(target, draft))
        seqs.append(Sequence(list(GREEDY_PROMPTS[p]), SamplingConfig(), n, make_generator(0), (),
                             proposer, POLICIES["fixed"](spec, target, proposer.runtime),
                             max_k=3 * spec.k))
    run_to_completion(runtime, seqs, max_batch=4)
    for seq, (method, p, n) in zip(seqs, members, strict=True):
        assert [t for s in seq.steps for t in s.tokens] == _plain(GREEDY_PROMPTS[p], n), method


def test_a_seeded_sampled_multi_member_is_the_same_alone_and_in_a_batch():
    hot = SamplingConfig(temperature=0.9)
    outputs = []
    for others in (0, 2):
        runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
        seqs = []
        for i in range(others + 1):
            spec = MULTI_SPECS["draft+ngram"]
            _, proposer = _proposer(spec)
            seqs.append(Sequence(list(GREEDY_PROMPTS[i]), hot, 20, make_generator(11 + i), (),
                                 proposer, FixedK(spec.k), max_k=2 * spec.k))
        run_to_completion(runtime, seqs)
        outputs.append([t for s in seqs[0].steps for t in s.tokens])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 20


# --- batched sessions: the batch's shared draft model drafts every member's chains ----------

BATCH_SPECS = {
    "draft+ngram": SpecConfig("multi", 3, multi_methods=("draft", "ngram")),
    "three-chains-spectr": SpecConfig("multi", 2, multi_methods=("draft",) * 3,
                                      multi_verifier="spectr"),
    "ngram+draft+draft": SpecConfig("multi", 2, multi_methods=("ngram", "draft", "draft")),
}
KV_BUDGET = 1 << 20  # bytes of KV per model: the tiny models' few short sequences


def _batch_engine(spec: SpecConfig) -> Engine:
    from test_engine import word_tokenizer

    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.3), capacity=256)
    return Engine.from_runtimes(target, word_tokenizer(), draft, spec)


@pytest.mark.parametrize("name", list(BATCH_SPECS))
def test_greedy_multi_with_the_draft_model_in_a_batched_session_equals_plain(name):
    """A session (as generate_batch and the server run one) of multi members, whose
    draft-model chains come from the batch's shared draft model, beside a plain member and a
    draft member: each member's tokens are its plain greedy decoding's; the draft model's
    passes hold several members."""
    spec = BATCH_SPECS[name]
    engine = _batch_engine(spec)
    session = BatchSession(engine, KV_BUDGET)
    draft = engine.batch_view("draft", KV_BUDGET)
    members, forward = [], draft.forward

    def counted(batch, *args, **kw):
        members.append(len(batch.seqs))
        return forward(batch, *args, **kw)

    draft.forward = counted
    cases = [(GREEDY_PROMPTS[0], 30, spec), (GREEDY_PROMPTS[1], 24, SpecConfig("none")),
             (GREEDY_PROMPTS[2], 20, spec), (GREEDY_PROMPTS[0][::-1], 26, spec),
             (GREEDY_PROMPTS[1], 22, SpecConfig("draft", 3))]
    seqs = [session.sequence(list(p), SamplingConfig(), n, s) for p, n, s in cases]
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
    for seq, (prompt, n, _) in zip(seqs, cases, strict=True):
        assert seq.error is None and [t for s in seq.steps for t in s.tokens] == \
            _plain(prompt, n), prompt
    assert sum(s.drafted for s in seqs[0].steps) > 0
    assert max(members) > 1, members
    assert draft.pool.live == 0 and session.target.pool.live == 0  # every region freed


def _chain_rows_hold(draft: Draft, tokens: list[int], draft_model: TorchRuntime) -> None:
    """Every node's q is the draft model's distribution after the sequence and the node's path
    (one fresh pass each: no cache state), and the root's siblings share one q exactly."""
    tree = TokenTree.of(draft.parents, len(draft.tokens))
    for i in range(len(tree)):
        path = [int(draft.tokens[j]) for j in tree.path(i)][:-1]
        draft_model.truncate(0)
        logits = draft_model.forward(torch.tensor([*tokens, *path])).logits[-1]
        assert torch.allclose(draft.q[i], logits_to_probs(logits, TEMPERATURE), atol=1e-9), i
    roots = tree.children[0]
    assert len(roots) > 1 and all(torch.equal(draft.q[r], draft.q[roots[0]]) for r in roots)


@pytest.mark.parametrize("batched", [False, True])
def test_k_chains_draw_their_roots_from_one_row_and_the_rest_from_their_paths(batched):
    """Three draft-model chains after a step that accepted tokens (the cache lacks four of the
    sequence's): the first chain's root row comes from a pass over those four, the others are
    drawn from that same row (bit for bit), and each chain's later tokens from the draft's
    distribution after its own path: alone and as members of a batch (the shared draft model)."""
    spec = BATCH_SPECS["three-chains-spectr"]
    target = TorchRuntime(tiny_model(0), capacity=64)
    prompts = [GREEDY_PROMPTS[0], GREEDY_PROMPTS[1]]
    if batched:
        shared = SharedDraftModel(BatchTorchRuntime(TorchRuntime(tiny_model(0, noise=0.3),
                                                                 capacity=64), KV_BUDGET), 64)
        ctx = ProposerContext(target, None, batch={SHARED_DRAFT: shared}, capacity=64)
        proposers = [PROPOSERS["multi"](spec, ctx) for _ in prompts]
    else:
        proposers = [PROPOSERS["multi"](spec, ProposerContext(target, TorchRuntime(
            tiny_model(0, noise=0.3), capacity=64))) for _ in prompts]
    requests = []
    for i, (proposer, prompt) in enumerate(zip(proposers, prompts, strict=True)):
        proposer.prefill(prompt)
        requests.append(DraftRequest(proposer, [*prompt, 3, 9, 27], spec.k, TEMPERATURE,
                                     make_generator(i)))
    made = (MULTI_DRAFTER.propose(requests) if batched else
            [r.proposer.propose(r.tokens, r.k, r.sampling, r.generator) for r in requests])
    reference = TorchRuntime(tiny_model(0, noise=0.3), capacity=64)
    for draft, r in zip(made, requests, strict=True):
        assert len(draft.tokens) == 3 * spec.k
        _chain_rows_hold(draft, r.tokens, reference)


BATCHED_RUNS, BATCHED_NEW = 1500, 5


def test_batched_multi_members_sample_the_target_joint(monkeypatch):
    """Fails by chance with probability 3 ALPHA. One batch a run of the three BATCH_SPECS
    members (tiny float64 transformers over V tokens, temperature 1), their draft-model chains
    drafted by one shared draft model in MultiDrafter's rounds, each with its own seeded
    generator: each member's NEW tokens over the runs against the target's exact joint."""
    target = BatchTorchRuntime(tiny_runtime(0, vocab=V, capacity=64), KV_BUDGET)
    shared = SharedDraftModel(BatchTorchRuntime(tiny_runtime(0, vocab=V, capacity=64, scale=1.0,
                                                             noise=0.5), KV_BUDGET), V)
    ctx = ProposerContext(target.single, None, batch={SHARED_DRAFT: shared}, capacity=64)
    counts = {name: defaultdict(int) for name in BATCH_SPECS}
    trees, join = Counter(), multi.join

    def counted(drafts, merges):
        d = join(drafts, merges)
        trees.update(trees=int(not TokenTree.of(d.parents, len(d.tokens)).is_chain))
        return d

    monkeypatch.setattr(multi, "join", counted)
    for run in range(BATCHED_RUNS):
        seqs = {}
        for i, (name, spec) in enumerate(BATCH_SPECS.items()):
            proposer = PROPOSERS["multi"](spec, ctx)
            seqs[name] = Sequence(list(PROMPT), TEMPERATURE, BATCHED_NEW,
                                  make_generator(7919 * run + i), (), proposer, FixedK(spec.k),
                                  max_k=spec.k * len(spec.multi_methods))
        run_to_completion(target, list(seqs.values()))
        for name, seq in seqs.items():
            counts[name][tuple(t for s in seq.steps for t in s.tokens)] += 1
    assert target.pool.live == 0 and shared.runtime.pool.live == 0
    assert trees["trees"] >= BATCHED_RUNS * len(BATCH_SPECS), trees  # a tree a member a run
    joint = target_joint(deep_rows("heads-target", TEMPERATURE), BATCHED_NEW)
    for name in BATCH_SPECS:
        assert chi_square_pvalue(joint, counts[name]) > ALPHA, name


# --- real weights ---------------------------------------------------------------------------

SMOL = "smollm2-135m-instruct"
REAL_PROMPTS = ["Write a Python function that checks whether a string is a palindrome.",
                "Explain what a hash map is in two sentences."]


@pytest.mark.real
def test_spectr_runs_on_real_bfloat16_weights():
    """SmolLM2-135M as its own draft in bfloat16 (torch), three draft chains verified by
    SpecTr at temperature 1, alone and in a batched session. After a step that accepted
    tokens the first chain's root row comes from a pass over several tokens; a row recomputed
    by a one-token pass differs from it in bfloat16, and SpecTr's check that the root's
    siblings share one q raised on every prompt here until the chains drew their roots from
    one row."""
    from forerun.models.load import open_model

    src = open_model(SMOL)
    engine = Engine.from_runtimes(src.load(dtype="bfloat16"), src.tokenizer,
                                  src.load(dtype="bfloat16"))
    spec = SpecConfig("multi", 2, multi_methods=("draft",) * 3, multi_verifier="spectr")
    hot = [SamplingConfig(temperature=1.0, seed=seed) for seed in range(len(REAL_PROMPTS))]
    alone = [engine.generate(p, sampling=s, max_tokens=24, spec=spec)
             for p, s in zip(REAL_PROMPTS, hot, strict=True)]
    together = engine.generate_batch(REAL_PROMPTS, sampling=hot, max_tokens=24, spec=spec)
    for out in [*alone, *together]:
        assert len(out.token_ids) == 24 and out.stats.accepted > 0


def test_the_server_s_worker_runs_multi_with_the_draft_model():
    """The server's worker (one continuous batch): multi requests drafted by the batch's
    shared draft model beside the n-gram lookup each stream their plain greedy tokens; a
    request's speculation field keeps the server's multi methods (resolve_spec)."""
    from test_serve_batch import run_jobs

    from forerun.serve.app import resolve_spec
    from forerun.serve.protocol import Speculation
    from forerun.serve.worker import Delta, Done, Job, Worker

    spec = BATCH_SPECS["ngram+draft+draft"]
    engine = _batch_engine(spec)
    asked, _ = resolve_spec(Speculation(k=3), spec, has_draft=True)
    assert asked.multi_methods == spec.multi_methods and asked.k == 3
    with pytest.raises(Exception, match="no draft model"):
        resolve_spec(Speculation(method="multi"), spec, has_draft=False)
    worker = Worker(engine, slots=3, max_queue=3, spec_policy="always")
    budgets = [20, 16, 18]
    out = run_jobs(worker, [Job(list(p), SamplingConfig(), n, (), s, emit=print) for p, n, s in
                            zip(GREEDY_PROMPTS, budgets, [spec, asked, spec], strict=True)])
    for i, (prompt, n) in enumerate(zip(GREEDY_PROMPTS, budgets, strict=True)):
        assert isinstance(out.end(i), Done), out.end(i)
        tokens = [t for e in out.events[i] if isinstance(e, Delta) for t in e.token_ids]
        assert tokens == _plain(prompt, n), i
    assert sum(out.end(i).stats.drafted for i in range(3)) > 0
