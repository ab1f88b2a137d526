"""Losslessness under sampling at the engine level, with drafts that really are deep.

On a 3-token vocabulary the target's exact joint distribution of the next NEW tokens is
enumerable; speculative decoding (the engine's own loop, with the real drafters) runs RUNS seeded
generations and a pooled chi-square test compares their sequences with it (tests/exact.py).
Target and draft model are tables over prefixes (tests/exact.py's TableModel: a run costs ~1 ms),
the head cases a tiny transformer (they draft from its features). NEW >= K + 2, so the first
verify step of every run drafts K tokens (the engine caps a draft at max_new - emitted - 1, and
the prefill emits one): chains K = 2..4 deep (draft model; n-gram lookup; the adaptive and the
cost policy, whose later lengths depend on earlier outcomes), trees two and three levels deep
(EAGLE, Medusa; a deterministic two-level tree drafter). Every test counts the draft tokens
proposed at each depth (tests/exact.py's `Recorder`, a wrapper around the proposer) and asserts
them, so no case is a one-token draft in disguise.

Power: the engine-level test with a broken verifier injected (tests/exact.py's chain mutants in
place of forerun.batch_verify.batch_rejection_sample under the draft model, its tree mutants in
place of recursive_rejection_sample under TopTwoTree) must fail. Each mutant's exact
distribution over the NEW tokens is computed (every draft, every verdict, every later step:
`engine_joint`; with the real verifier it is the target's joint to 1e-16), and from it the
test's power (noncentral chi-square, asymptotic); `test_the_stated_engine_powers_hold`
recomputes the figures stated in MUTANTS.

False failures: each of the 6 CASES, the 2 HEAD_CASES and the TopTwoTree check fails by chance
with probability ALPHA = 1e-4 (asymptotic chi-square); each of the 7 mutant checks with its
stated escape probability (4.1e-11 at most). Module total: 9 * 1e-4 + 5e-11 < 1e-3.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import pytest
import torch
from conftest import random_heads, tiny_runtime
from exact import (
    Bug,
    DraftCase,
    Recorder,
    RuntimeTable,
    TableModel,
    TableRuntime,
    chain_mutant,
    chi_square_power,
    chi_square_pvalue,
    drafts,
    target_joint,
    tree_mutant,
    tv,
    verdict_distribution,
)

import forerun.batch_verify
from forerun.engine import speculative_decode
from forerun.policy import AdaptiveK, CostModelK, FixedK
from forerun.profile import ForwardCurve
from forerun.propose import HEAD_PROPOSERS
from forerun.propose.base import Draft, Needs
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.ngram import NgramProposer
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.tree import TokenTree
from forerun.verify_batch import each_member

pytestmark = pytest.mark.usefixtures("one_thread")
V, ALPHA, RUNS, HEAD_RUNS = 3, 1e-4, 2000, 1000
PROMPT = [1, 2, 0, 1, 2, 0, 1]  # repeats, so n-gram lookup drafts from the first step on
TEMPERATURE = SamplingConfig(temperature=1.0)
TOP_P = SamplingConfig(temperature=0.8, top_p=0.9)
TOP_K = SamplingConfig(temperature=1.3, top_k=2)
# drafting pays on this curve (conftest's scale): the cost policy drafts 3 at its prior, less
# after rejections, so the draft length depends on earlier outcomes (and the output must not)
COST_CURVE = ForwardCurve((1, 2, 3, 4, 5), (1.0, 1.05, 1.1, 1.15, 1.2))
COST_DRAFT_SECONDS = 0.02


# The target and the draft model: tables over prefixes (tests/exact.py), logits ~ N(0, 1) per
# token, the draft's perturbed by N(0, 1): it agrees often, not always. The head cases need
# a target with features: the tiny transformer (conftest), float64 like the tables.
TARGET = TableModel(V, seed=1)
DRAFT = TableModel(V, seed=1, noise=1.0)


def target_model():
    return TableRuntime(TARGET)


def draft_model():
    return TableRuntime(DRAFT)


def heads_target():
    return tiny_runtime(0, vocab=V)


@cache
def rows(model: str, sampling: SamplingConfig):
    """prefix (generated tokens) -> the model's distribution after PROMPT + prefix, for
    "target", "draft" (the tables) or "heads-target" (the transformer, one pass a prefix)."""
    table = {"target": TARGET, "draft": DRAFT}.get(model) or RuntimeTable(heads_target())

    @cache
    def row(prefix: tuple[int, ...]) -> torch.Tensor:
        return logits_to_probs(table.logits((*PROMPT, *prefix)), sampling)

    return row


def empirical(proposer, policy, sampling, new_tokens, runs=RUNS, seed=2024, target=None):
    """-> (counts of the generated sequences, draft tokens proposed at each depth)."""
    target, recorder = target or target_model(), Recorder(proposer)
    generator, counts = make_generator(seed), defaultdict(int)
    for _ in range(runs):
        steps = speculative_decode(target, recorder, policy(), PROMPT, sampling, new_tokens, (),
                                   generator)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    return counts, recorder.depths


def check(counts, sampling, new_tokens, target="target") -> float:
    return chi_square_pvalue(target_joint(rows(target, sampling), new_tokens), counts)


# --- the engine with real drafters, K = 2..4 deep ----------------------------------------------

def draft_proposer():
    return DraftModelProposer(draft_model(), V)


CASES = {  # name -> (proposer, policy, sampling, K, NEW)
    "draft-k3-temperature": (draft_proposer, lambda: FixedK(3), TEMPERATURE, 3, 5),
    "draft-k4-top-p": (draft_proposer, lambda: FixedK(4), TOP_P, 4, 6),
    "draft-k2-top-k": (draft_proposer, lambda: FixedK(2), TOP_K, 2, 4),
    "ngram-k3-temperature": (lambda: NgramProposer(1, 4), lambda: FixedK(3), TEMPERATURE, 3, 5),
    "draft-adaptive-from-3": (draft_proposer, lambda: AdaptiveK(3), TEMPERATURE, 3, 7),
    "draft-cost-policy": (draft_proposer, lambda: CostModelK(4, COST_CURVE, COST_DRAFT_SECONDS),
                          TEMPERATURE, 3, 7),
}
# n-gram lookup drafts K deep only where the text continues the prompt's period (a run of
# 2 0 1 2 ...); at least this share of runs does so at some step (measured: 0.2)
NGRAM_DEEP_SHARE = 0.1


@pytest.mark.parametrize("name", list(CASES))
def test_deep_drafts_match_the_target_joint(name):
    """Fails by chance with probability ALPHA. The first step of every run drafts K tokens
    (the draft model; n-gram lookup K deep in NGRAM_DEEP_SHARE of the runs or more). The
    adaptive policy starts at 3 and shrinks after a rejection, the cost policy drafts 3 at its
    prior acceptance and fewer after rejections: with NEW = 7 their later drafts are shorter
    than the cap would make them, so their lengths depend on earlier outcomes."""
    make, policy, sampling, K, new_tokens = CASES[name]
    counts, depths = empirical(make(), policy, sampling, new_tokens)
    deep = NGRAM_DEEP_SHARE * RUNS if name.startswith("ngram") else RUNS
    assert all(depths[d] >= deep for d in range(1, K + 1)) and max(depths) == K, depths
    if new_tokens == 7:  # a fixed K = 3 would draft 3 deep at the second step of most runs
        assert depths[3] < 1.5 * RUNS, depths
    assert check(counts, sampling, new_tokens) > ALPHA


HEAD_CASES = {  # name -> (kind, tree node budget, sampling, K)
    "medusa-tree-3-levels": ("medusa", 6, TEMPERATURE, 3),
    "eagle-tree-2-levels": ("eagle", 5, TOP_P, 2),
}


@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_deep_head_drafts_match_the_target_joint(name):
    """Random heads (q = None: their drafts are chosen, not sampled), trees of two children a
    node cut to the node budget; fails by chance with probability ALPHA."""
    kind, budget, sampling, K = HEAD_CASES[name]
    target = heads_target()
    heads = random_heads(kind, target, scale=0.5)
    new_tokens = K + 2
    proposer = HEAD_PROPOSERS[kind](heads, target.capacity, budget, 2)
    counts, depths = empirical(proposer, lambda: FixedK(K), sampling, new_tokens, HEAD_RUNS,
                               target=target)
    # every first step grows the tree K levels deep (the budget keeps some node at each)
    assert all(depths[d] >= HEAD_RUNS for d in range(1, K + 1)) and max(depths) == K, depths
    if budget:
        assert sum(depths.values()) > HEAD_RUNS * K  # more than a chain's worth: trees
    assert check(counts, sampling, new_tokens, "heads-target") > ALPHA


# --- power: the engine with a broken verifier ---------------------------------------------------

class TopTwoTree:
    """A deterministic two-level tree drafter: the draft model's two likeliest tokens after
    the sequence, each with its own two likeliest children (q = None). Its tree after any
    prefix is computable (`tree_case`), so the engine's exact output distribution is too."""

    name, runtime, needs, group = "top-two", None, Needs(), None  # the tokens alone

    def __init__(self, sampling: SamplingConfig):
        self.sampling = sampling

    def prefill(self, prompt):
        self.start = len(prompt)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        if k < 2:
            return Draft.empty()
        case = tree_case(tuple(tokens[self.start:]), self.sampling)
        return Draft(case.tokens, None, torch.tensor(TOP_TWO_PARENTS))

    def commit(self, num_final):
        pass


TOP_TWO_PARENTS = (-1, -1, 0, 0, 1, 1)


def tree_case(prefix: tuple[int, ...], sampling: SamplingConfig) -> DraftCase:
    """TopTwoTree's draft after `prefix` (the generated tokens), with the target's rows."""
    p_of, q_of, tree = rows("target", sampling), rows("draft", sampling), TokenTree(TOP_TWO_PARENTS)
    first = q_of(prefix).topk(2).indices.tolist()
    tokens = [*first, *(t for x in first for t in q_of((*prefix, x)).topk(2).indices.tolist())]
    p = torch.stack([p_of(prefix)] + [p_of(prefix + tuple(tokens[j] for j in tree.path(i)))
                                      for i in range(len(tokens))])  # [7, V]
    return DraftCase(1.0, torch.tensor(tokens, dtype=torch.long), None, p)


def engine_joint(sampling: SamplingConfig, K: int, new_tokens: int, bug: Bug,
                 tree: bool = False) -> dict[tuple[int, ...], float]:
    """The exact distribution of what the engine generates with the (mutant) verifier: the
    prefill's token from p, then each step's k = min(K, new - emitted - 1) deep draft (every
    draft-model chain with its probability, or TopTwoTree's tree), every verdict, recursively."""
    p_of, q_of = rows("target", sampling), rows("draft", sampling)
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) >= new_tokens:
            out[prefix[:new_tokens]] += prob
            return
        k = min(K, new_tokens - len(prefix) - 1)
        if tree:
            shape = TokenTree(TOP_TWO_PARENTS) if k >= 2 else TokenTree(())
            cases = [tree_case(prefix, sampling)] if k >= 2 else drafts(shape, p_of, q_of, prefix)
        else:
            shape = TokenTree.chain(k)
            cases = drafts(shape, p_of, q_of, prefix)
        for case in cases:
            for seq, pr in verdict_distribution(shape, case.tokens, case.p,
                                                None if tree else case.q, bug).items():
                walk(prefix + seq, prob * case.probability * pr)

    first = p_of(())
    for y in range(V):
        if first[y] > 0:
            walk((y,), float(first[y]))
    return out


# mutant -> (bug, a tree mutant?, its stated P(escape) in RUNS runs): the chain mutants under
# the draft model (K = 3, NEW = 5), the tree ones under TopTwoTree (2 levels, NEW = 4), both at
# temperature 1. Exact TV from the target's joint: 0.257, 0.127, 0.234, 0.424; 0.238, 0.179, 0.181.
MUTANTS = {
    "chain-(i)-recovered-from-p": (Bug(recovered="p"), False, 1e-15),
    "chain-(ii)-recovered-over-the-support": (Bug(recovered="support"), False, 4.1e-11),
    "chain-(iii)-bonus-from-the-row-before": (Bug(bonus_from_parent=True), False, 1e-15),
    "chain-(iv)-q-off-by-one": (Bug(q_from_previous=True), False, 1e-15),
    "tree-(i)-recovered-from-p": (Bug(recovered="p"), True, 1e-15),
    "tree-(iii)-bonus-from-the-parent-row": (Bug(bonus_from_parent=True), True, 1e-15),
    "tree-(v)-siblings-tested-against-p": (Bug(siblings_vs_p=True), True, 1e-15),
}
CHAIN_K, TREE_K = 3, 2


def test_a_deterministic_tree_drafter_matches_the_target_joint():
    """TopTwoTree, the drafter of the tree mutants' tests, with the real verifier (fails by
    chance with probability ALPHA): 4 nodes at depth 2 in every run's first step."""
    counts, depths = empirical(TopTwoTree(TEMPERATURE), lambda: FixedK(TREE_K), TEMPERATURE,
                               TREE_K + 2)
    assert depths[1] >= 2 * RUNS and depths[2] >= 4 * RUNS and max(depths) == 2, depths
    assert check(counts, TEMPERATURE, TREE_K + 2) > ALPHA


@pytest.mark.parametrize("name", list(MUTANTS))
def test_the_engine_with_a_mutant_verifier_fails(name, monkeypatch):
    """The deep engine test with a broken verifier in the engine: its p-value must fall below
    ALPHA (it does not with the probability stated in MUTANTS)."""
    bug, is_tree, _ = MUTANTS[name]
    if is_tree:
        monkeypatch.setitem(forerun.batch_verify.TREE_VERIFIERS, "rrs", tree_mutant(bug))
        proposer, K = TopTwoTree(TEMPERATURE), TREE_K
    else:
        monkeypatch.setattr(forerun.batch_verify, "batch_rejection_sample",
                            each_member(chain_mutant(bug)))
        proposer, K = draft_proposer(), CHAIN_K
    counts, depths = empirical(proposer, lambda: FixedK(K), TEMPERATURE, K + 2)
    assert depths[K] >= RUNS  # as deep as the passing tests' drafts
    assert check(counts, TEMPERATURE, K + 2) < ALPHA


def test_the_stated_engine_powers_hold():
    """The engine's exact output distribution: with the real verifier it is the target's joint
    (losslessness over whole generations, every later step included); with each mutant its
    escape probability at its runs is at most the figure stated in MUTANTS."""
    for K, tree in ((CHAIN_K, False), (TREE_K, True)):
        joint = target_joint(rows("target", TEMPERATURE), K + 2)
        assert tv(engine_joint(TEMPERATURE, K, K + 2, Bug(), tree), joint) < 1e-12
    for bug, is_tree, stated in MUTANTS.values():
        K = TREE_K if is_tree else CHAIN_K
        joint = target_joint(rows("target", TEMPERATURE), K + 2)
        actual = engine_joint(TEMPERATURE, K, K + 2, bug, is_tree)
        assert 1 - chi_square_power(joint, actual, RUNS, ALPHA) <= stated, bug
