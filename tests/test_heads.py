"""Token trees, tree verification and the head drafters (Medusa, Hydra, EAGLE, EAGLE-3).

Trees are checked against hand-drawn expectations; a tree pass against chain passes over each
path; greedy head speculation (chains and trees, random heads) against plain greedy decoding;
sampling with trees against the target's exact joint distribution (the chi-square test of
test_lossless_sampling, false-failure probability ALPHA = 1e-4 per check); training on a tiny
target must lower the loss and raise agreement; heads survive a save/load round trip.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from conftest import random_heads, tiny_runtime
from test_lossless_sampling import ALPHA, PROMPT, RUNS, V, chi_square_pvalue, exact_joint
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun.api import LoadConfig, head_precision
from forerun.bench.workloads import BUILTIN, read_workload
from forerun.engine import speculative_decode
from forerun.heads import (
    PRECISIONS,
    DraftLinear,
    HeadError,
    TargetIO,
    load_heads,
    save_heads,
    w8a8_available,
)
from forerun.policy import FixedK
from forerun.propose import HEAD_PROPOSERS, PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import Draft, Needs
from forerun.propose.eagle import EagleProposer
from forerun.propose.heads import (
    AUTO_TREE,
    AUTO_TREE_MAX,
    CATCHUP_ROWS,
    MIN_IDLE,
    next_depth,
)
from forerun.propose.ngram import LOOKUP_PRIOR_PER_N, LookupBranch, run_prior
from forerun.reference import plain_decode
from forerun.runtime.static import MIN_SPAN, span_of, top
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.train import TrainConfig, chat_prompts, corpus_vocab, teacher, train
from forerun.tree import TokenTree, best_budget, candidates, graft, grow_tree, match_depth, prune
from forerun.verify import recursive_rejection_sample

GREEDY = SamplingConfig(temperature=0)
KINDS = ["medusa", "hydra", "eagle", "eagle3"]

NO_FBGEMM = pytest.mark.skipif(not w8a8_available(), reason="w8a8 needs torch's fbgemm (x86)")


# --- the tree type ------------------------------------------------------------------------

def test_hand_drawn_tree():
    tree = TokenTree((-1, -1, 0, 0, 2))  # the docstring's drawing
    assert tree.depth == (1, 1, 2, 2, 3)
    assert tree.children == ((0, 1), (2, 3), (), (4,), (), ())
    assert tree.paths() == [[1], [0, 3], [0, 2, 4]]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 13]
    #                     root n0 n1 n2 n3 n4
    expected = torch.tensor([[1, 0, 0, 0, 0, 0],   # root
                             [1, 1, 0, 0, 0, 0],   # n0
                             [1, 0, 1, 0, 0, 0],   # n1
                             [1, 1, 0, 1, 0, 0],   # n2
                             [1, 1, 0, 0, 1, 0],   # n3
                             [1, 1, 0, 1, 0, 1]],  # n4
                            dtype=torch.bool)
    assert torch.equal(tree.mask(), expected)
    assert not tree.is_chain


def test_chain_tree_is_causal():
    tree = TokenTree.chain(4)
    assert tree.is_chain and tree.paths() == [[0, 1, 2, 3]]
    assert torch.equal(tree.mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    assert tree.positions(3).tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="parents must come first"):
        TokenTree((-1, 2, 0))


def test_grow_tree_keeps_the_likeliest_paths():
    root = torch.tensor([0.5, 0.3, 0.2]).log()
    level2 = torch.tensor([0.9, 0.1, 0.0]).log()
    tokens, parents = grow_tree(root, lambda frontier, found: level2.expand(len(frontier), -1),
                                depth=2, topk=2, beam=1, budget=3)
    # candidates: 0 (.5), 1 (.3), 0>0 (.45), 0>1 (.05): the best three, parents first
    assert (tokens, parents) == ([0, 1, 0], [-1, -1, 0])
    chain = grow_tree(root, lambda f, _: level2.expand(len(f), -1), depth=3, topk=1, beam=1,
                      budget=3)
    assert chain == ([0, 0, 0], [-1, 0, 1])
    # a budget function: only nodes it would keep so far are expanded
    expanded = []

    def expand(frontier, found):
        expanded.append(list(frontier))
        return level2.expand(len(frontier), -1)

    def two(scores):
        return min(2, len(scores))

    assert grow_tree(root, expand, depth=3, topk=2, beam=2, budget=two) == ([0, 0], [-1, 0])
    assert expanded == [[0, 1], [2]]  # level 3: 0>0 (.45), not 1>0 (.27): it ranks 4th


def test_two_stage_top_k_and_head_attention_spans():
    """`top` (chunks' top k, then theirs) equals topk on long rows, falls back to topk on
    rows it cannot chunk; a head step's attention span is a power of two past its rows, at
    least MIN_SPAN, at most the cache."""
    x = torch.randn(3, 16_384, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 4, 8):
        got, want = top(x, k), x.topk(k, dim=-1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    y = torch.randn(2, 300)
    assert torch.equal(top(y, 3)[1], y.topk(3, dim=-1)[1])
    assert [span_of(e, 2304) for e in (1, 256, 257, 1500, 2049, 2304)] == [
        MIN_SPAN, 256, 512, 2048, 2304, 2304]


def test_an_automatic_device_tree_grows_as_deep_as_its_cuts_keep():
    """Under an automatic budget the device tree's depth follows the cuts: one level past
    the deepest kept node (a power of two), twice as deep when the cut kept the bottom."""
    assert next_depth([], 4) == 1  # nothing kept: the root's children only
    assert next_depth([-1, 0, 1], 4) == 4
    assert next_depth([-1, 0, 1, 2], 4) == 8
    assert next_depth([-1, -1, 0], 8) == 4
    target = tiny_runtime(0)
    proposer = EagleProposer(random_heads("eagle", target), target.capacity, AUTO_TREE, 2,
                             verify=lambda n: 1.0, static=True)  # a flat curve keeps all
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    depths = []
    for step in speculative_decode(target, proposer, FixedK(16), prompt, GREEDY, 12, (),
                                   make_generator(0)):
        depths.append(proposer.device_depth)
        del step
    # the prompt's step drafts nothing; then 4 levels are grown and kept whole, then 8
    assert depths[:3] == [4, 8, 16]


def test_a_tree_grown_elsewhere_prunes_as_grow_tree_does():
    """Flat arrays of a tree grown on a device (scores, tokens, parents, level by level) ->
    candidates with their depths, nodes of log-probability -inf and their descendants left
    out (grow_tree never adds them); then EAGLE-2's rerank keeps the likeliest paths."""
    inf = float("-inf")
    # root -> a (-0.1), b (-2.0), c (-inf); a -> d (-0.3), e (-1.0); c -> f (-inf)
    found = candidates([-0.1, -2.0, inf, -0.3, -1.0, inf], [10, 11, 12, 13, 14, 15],
                       [-1, -1, -1, 0, 0, 2])
    assert [(c.token, c.parent, c.depth) for c in found] == [
        (10, -1, 1), (11, -1, 1), (13, 0, 2), (14, 0, 2)]
    assert prune(found, 2) == ([10, 13], [-1, 0])
    assert prune(found, 3) == ([10, 13, 14], [-1, 0, 0])
    assert prune(found, len) == ([10, 11, 13, 14], [-1, -1, 0, 0])


# --- tree verification in the torch runtime ---------------------------------------------

PROMPT_T = [3, 1, 4, 1, 5, 9, 2, 6]


def test_tree_pass_rows_equal_chain_passes_over_their_paths():
    tree = TokenTree((-1, -1, 0, 0, 2))
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])  # root (pending), then the nodes
    rt = tiny_runtime(0)
    rt.forward(torch.tensor(PROMPT_T))
    base = rt.length
    logits = rt.forward(tokens, positions=tree.positions(base), tree_mask=tree.mask()).logits
    for row in range(len(tree) + 1):
        path = [0, *(i + 1 for i in tree.path(row - 1))]
        ref = tiny_runtime(0)
        expected = ref.forward(torch.tensor(PROMPT_T + tokens[path].tolist())).logits[-1]
        torch.testing.assert_close(logits[row], expected, rtol=1e-9, atol=1e-9)


def test_keep_compacts_the_cache_to_the_accepted_path():
    tree = TokenTree((-1, -1, 0, 0, 2))
    tokens = torch.tensor([7, 8, 9, 10, 11, 12])
    rt = tiny_runtime(0)
    rt.forward(torch.tensor(PROMPT_T))
    base = rt.length
    rt.forward(tokens, positions=tree.positions(base), tree_mask=tree.mask())
    rows = [0, 1, 3, 5]  # root, n0, n2, n4
    rt.keep(base, rows)
    assert rt.length == base + 4
    after = rt.forward(torch.tensor([13])).logits[-1]
    ref = tiny_runtime(0)
    expected = ref.forward(torch.tensor(PROMPT_T + tokens[rows].tolist() + [13])).logits[-1]
    torch.testing.assert_close(after, expected, rtol=1e-9, atol=1e-9)


def test_one_branch_tree_verdict_equals_chain_verdict_greedy():
    rt = tiny_runtime(0)
    p = logits_to_probs(rt.forward(torch.tensor(PROMPT_T)).logits[-4:], GREEDY)  # [4, V]
    draft = p[:3].argmax(-1).clone()
    draft[2] = (draft[2] + 1) % p.shape[1]  # the third draft token is wrong
    verdict = recursive_rejection_sample(TokenTree.chain(3), draft, p, None, make_generator(0))
    assert verdict.path == [0, 1] and verdict.tokens == [*draft[:2].tolist(), int(p[2].argmax())]


def test_recursive_rejection_first_token_has_the_target_distribution():
    """Three siblings drawn without replacement from q (q renormalised after each): the first
    output token must be distributed as p, exactly; checked by chi-square over 20,000 draws."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    Vs = 5
    p = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]] * 4, dtype=torch.float64)
    q0 = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)
    counts = torch.zeros(Vs)
    tree = TokenTree((-1, -1, -1))
    for _ in range(20000):
        qs, left, picked = [], q0.clone(), []
        for _ in range(3):
            q = left / left.sum()
            x = int(torch.multinomial(q, 1, generator=g))
            qs.append(q)
            picked.append(x)
            left = left.clone()
            left[x] = 0
        verdict = recursive_rejection_sample(tree, torch.tensor(picked), p, torch.stack(qs), g)
        counts[verdict.tokens[0]] += 1
    assert chisquare(counts.numpy(), (p[0] * 20000).numpy()).pvalue > ALPHA


# --- heads: greedy equality, sampling, errors ---------------------------------------------

def decode(target, proposer, k, sampling, n, generator):
    steps = list(speculative_decode(target, proposer, FixedK(k), PROMPT_T, sampling, n, (),
                                    generator))
    return [t for s in steps for t in s.tokens], steps


def test_best_budget_follows_the_verify_curve():
    scores = torch.tensor([0.9, 0.5, 0.2, 0.05]).log().tolist()
    assert best_budget(scores, lambda n: float(n)) == 0  # a pass per token: never pays
    # 1.9/1.1, 2.4/1.2 = 2.6/1.3 (ties keep the smaller tree), 2.65/1.4
    assert best_budget(scores, lambda n: 1 + 0.1 * (n - 1)) == 2
    assert best_budget(scores, lambda n: 1.0) == 4  # a flat curve (a GPU): all of them
    # a less trusted drafter: 1.45/1.3 beats 1.7/1.6
    assert best_budget(scores, lambda n: 1 + 0.3 * (n - 1), scale=0.5) == 1
    assert best_budget([], lambda n: 1.0) == 0
    # the drafter's own seconds a step count against drafting (2.6/3.3 at best < 1/1, plain)
    assert best_budget(scores, lambda n: 1 + 0.1 * (n - 1), overhead=2.0) == 0
    # and, paid once a step, favour more nodes: 2.6/1.4 > 2.4/1.3
    assert best_budget(scores, lambda n: 1 + 0.1 * (n - 1), overhead=0.1) == 3


def test_auto_tree_budget_is_cut_by_the_curve_and_calibrated():
    target = tiny_runtime(0)
    heads = random_heads("eagle", target)
    flat = EagleProposer(heads, target.capacity, AUTO_TREE, 3, verify=lambda n: 1.0)
    steep = EagleProposer(heads, target.capacity, AUTO_TREE, 3, verify=lambda n: float(n))
    sizes, drafts = [], []
    for proposer in (flat, steep):
        proposer.prefill(PROMPT_T)
        target.truncate(0)
        proposer.feed(target.forward(torch.tensor(PROMPT_T), hidden_layers=(-1,)).hidden)
        draft = proposer.propose([*PROMPT_T, 1], 3, GREEDY, make_generator(0))
        sizes.append(len(draft.tokens))
        drafts.append(draft.tokens.tolist())
        proposer.commit(len(PROMPT_T) + 1)  # nothing accepted, the target's own token follows
    assert sizes[0] > sizes[1] == 0
    # the next step learns how deep the last tree followed the accepted tokens (none here)
    row = target.forward(torch.tensor([1]), hidden_layers=(-1,)).hidden
    miss = next(t for t in range(10) if t not in drafts[0])
    flat.feed(row)
    flat.propose([*PROMPT_T, 1, miss], 3, GREEDY, make_generator(0))
    assert flat.scale < 1.0 == steep.scale  # a confidence that failed is scaled down
    # a curve that wants no draft: the head rests MIN_IDLE steps, then probes (and rests longer)
    tokens = [*PROMPT_T, 1]
    rest = []
    for _ in range(MIN_IDLE + 1):  # as in the engine: each step's token and its feature
        steep.feed(row)
        tokens.append(2)
        rest.append(len(steep.propose(tokens, 3, GREEDY, make_generator(0)).tokens))
        steep.commit(len(tokens) - 1)
    assert rest == [0] * (MIN_IDLE + 1) and steep.skip == 2 * MIN_IDLE
    assert sizes[0] <= AUTO_TREE_MAX


def test_a_backlog_catch_up_is_priced_as_a_drafting_step(monkeypatch):
    # the head's seconds a step count its catch-up over at most CATCHUP_ROWS features: a
    # prompt's (or a rest's) backlog is a one-off, not what each drafting step costs
    target = tiny_runtime(0)
    proposer = EagleProposer(random_heads("eagle", target), target.capacity, AUTO_TREE, 3,
                             verify=lambda n: float(n))
    proposer.prefill(PROMPT_T)
    target.truncate(0)
    proposer.feed(target.forward(torch.tensor(PROMPT_T), hidden_layers=(-1,)).hidden)
    clock = iter([0.0, 10.0, 12.0])  # started, the root (catch-up) done, the tree done
    monkeypatch.setattr("forerun.propose.heads.perf_counter", lambda: next(clock))
    proposer.propose([*PROMPT_T, 1], 3, GREEDY, make_generator(0))
    rows = len(PROMPT_T)  # the prompt's features, caught up in the first step
    assert proposer.committed == rows > CATCHUP_ROWS
    assert proposer.head_seconds == pytest.approx(2.0 + 10.0 * CATCHUP_ROWS / rows)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [0, 7, AUTO_TREE])
@pytest.mark.parametrize("lookup", [False, True])  # with the prompt-lookup branch too
def test_greedy_head_speculation_equals_plain_greedy(kind, tree, lookup, synthetic_curves):
    """An automatic budget prices its trees on a flat synthetic curve (conftest), on which
    random heads' trees pay, so every cell drafts on any machine."""
    reference = [t for s in plain_decode(tiny_runtime(0), PROMPT_T, GREEDY, 40, (),
                                         make_generator(0)) for t in s.tokens]
    target = tiny_runtime(0)
    synthetic_curves(target, per_token=0.0)
    heads = random_heads(kind, target)
    spec = SpecConfig(kind, 3, tree=tree, tree_topk=3, lookup=lookup)
    proposer = PROPOSERS[kind](spec, ProposerContext(target, heads=heads))
    out, steps = decode(target, proposer, 3, GREEDY, 40, make_generator(0))
    assert out == reference and all(s.drafted <= 3 for s in steps)
    assert sum(s.drafted for s in steps) > 0


# --- heads + the prompt-lookup branch ----------------------------------------------------


def test_graft_shares_matching_nodes_and_match_depth_follows_the_tokens():
    tokens, parents = [7, 8, 9, 10], [-1, -1, 0, 2]  # 7 -> 9 -> 10 and 8
    assert graft(tokens, parents, [7, 9, 11, 12]) == ([7, 8, 9, 10, 11, 12],
                                                      [-1, -1, 0, 2, 2, 4])
    assert graft(tokens, parents, [5]) == ([7, 8, 9, 10, 5], [-1, -1, 0, 2, -1])
    assert graft(tokens, parents, [7, 9]) == (tokens, parents)  # already a path
    assert graft([], [], [4, 5]) == ([4, 5], [-1, 0])
    assert match_depth(tokens, parents, [7, 9, 10, 3]) == 3
    assert match_depth(tokens, parents, [8, 1]) == 1
    assert match_depth(tokens, parents, [1]) == match_depth(tokens, parents, []) == 0


def test_lookup_branch_learns_its_acceptance_from_what_followed():
    branch = LookupBranch(1, 2)  # run classes 1, then 2-3, 4-7, 8-15, 16+
    assert [branch.run_class(r) for r in (1, 2, 3, 4, 7, 8, 16, 99)] == [1, 2, 2, 4, 4, 8, 16, 16]
    seq = [5, 6, 7, 8, 5, 6]
    chain, scores = branch.propose(seq, 3)
    assert chain == [7, 8, 5]
    # the suffix [5, 6] matched and the token before it (8) disagrees with the one before the
    # occurrence (none): a run of 2; each token taken would make it one longer
    a2, a4 = run_prior(2, 2), run_prior(4, 2)
    assert a4 > a2 > run_prior(1, 2) == LOOKUP_PRIOR_PER_N  # a longer run: a likelier copy
    assert scores == pytest.approx([math.log(a2), 2 * math.log(a2), 2 * math.log(a2)
                                    + math.log(a4)])
    assert branch.acceptance(1) < a2  # a shorter run is trusted less
    # the target went on as the chain said: 3 of 3, at runs 2, 3 and 4
    chain, scores = branch.propose([*seq, 7, 8, 5, 6], 3)
    assert branch.acceptance(2) > a2 and branch.acceptance(4) > a4
    assert branch.acceptance(1) == LOOKUP_PRIOR_PER_N
    # now the whole text before [5, 6] repeats: a run of 6 (class 4-7), priced as such
    assert chain == [7, 8, 5] and scores[0] == pytest.approx(math.log(branch.acceptance(6)))
    before = branch.acceptance(4)
    branch.propose([*seq, 7, 8, 5, 6, 1], 3)  # the target chose 1: a miss at run 6
    assert branch.acceptance(4) < before and branch.acceptance(2) > a2
    assert branch.propose([1, 2, 3], 3) == ([], [])  # nothing to look up
    branch.reset()
    assert branch.acceptance(2) == a2


def test_lookup_branch_copies_the_occurrence_with_the_longest_run():
    branch = LookupBranch(1, 2)
    # the suffix [3, 4] occurred twice: latest followed by 11 after a 9 (run 2), earlier
    # followed by 10 after a 2, as now (run 3): the earlier one is the copy in progress
    seq = [1, 2, 3, 4, 10, 9, 3, 4, 11, 2, 3, 4]
    chain, scores = branch.propose(seq, 2)
    assert chain == [10, 9]
    assert scores[0] == pytest.approx(math.log(branch.acceptance(3)))
    branch.reset()
    assert branch.propose([*seq[:-3], 9, 3, 4], 2)[0] == [11, 9]  # now the latest runs longer


def test_heads_with_lookup_draft_the_continuation_as_a_path():
    target = tiny_runtime(0)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    for tree in (0, 5):
        proposer = EagleProposer(random_heads("eagle", target), target.capacity, tree, 2,
                                 lookup=LookupBranch(1, 4))
        proposer.prefill(prompt)
        target.truncate(0)
        proposer.feed(target.forward(torch.tensor(prompt), hidden_layers=(-1,)).hidden)
        draft = proposer.propose([*prompt, 8], 3, GREEDY, make_generator(0))
        tree_of = TokenTree.of(draft.parents, len(draft.tokens))
        toks = draft.tokens.tolist()
        assert [9, 5, 6] in [[toks[i] for i in p] for p in tree_of.paths()]
        assert len(toks) <= (tree or 3) + 3 and proposer.name == "eagle+lookup"


def test_lookup_is_for_head_methods_only():
    with pytest.raises(ValueError, match="lookup joins a head method"):
        SpecConfig("ngram", lookup=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["bfloat16", "int8", pytest.param("w8a8", marks=NO_FBGEMM)])
def test_heads_drafting_in_a_cheaper_precision_equal_plain_greedy(kind, precision):
    """Heads whose weights are cast or quantized for drafting draft other tokens at most;
    the output stays the target's."""
    reference = [t for s in plain_decode(tiny_runtime(0), PROMPT_T, GREEDY, 40, (),
                                         make_generator(0)) for t in s.tokens]
    target = tiny_runtime(0)
    heads = random_heads(kind, target).for_drafting(precision)
    assert heads.lm_draft is not None and not any(
        isinstance(m, torch.nn.Linear) for m in heads.modules())
    proposer = PROPOSERS[kind](SpecConfig(kind, 3, tree=7, tree_topk=3),
                               ProposerContext(target, heads=heads))
    out, steps = decode(target, proposer, 3, GREEDY, 40, make_generator(0))
    assert out == reference and sum(s.drafted for s in steps) > 0


@pytest.mark.parametrize("precision, tolerance",
                         [("bfloat16", 0.01), ("int8", 0.02),
                          pytest.param("w8a8", 0.04, marks=NO_FBGEMM)])
def test_draft_linear_stays_close_to_the_float32_layer(precision, tolerance):
    torch.manual_seed(0)
    layer = torch.nn.Linear(96, 40)
    x = torch.randn(3, 5, 96)  # any leading dimensions
    y = DraftLinear(layer.weight, layer.bias, precision)(x)
    assert y.shape == (3, 5, 40) and y.dtype == torch.float32
    with torch.no_grad():
        exact = layer(x)
    assert ((y - exact).norm() / exact.norm()).item() < tolerance


@NO_FBGEMM
def test_w8a8_keeps_the_feature_readers_in_int8():
    """The linears that read the target's features (outlier channels) keep int8 weights with
    bfloat16 inputs; the head's own layer and the LM slice quantize their inputs too."""
    heads = random_heads("eagle", tiny_runtime(0)).for_drafting("w8a8")
    kinds = {name: m.precision for name, m in heads.named_modules()
             if isinstance(m, DraftLinear)}
    assert kinds.pop("fc") == "int8" and set(kinds.values()) == {"w8a8"}
    assert len(kinds) == 5  # wqkv, wo, w_gate_up, w_down and lm_draft
    for kind in ("medusa", "hydra"):
        heads = random_heads(kind, tiny_runtime(0)).for_drafting("w8a8")
        assert {m.precision for n, m in heads.named_modules()
                if n.startswith("blocks.") and isinstance(m, DraftLinear)} == {"int8"}


def test_auto_head_precision_is_one_of_the_precisions():
    assert head_precision("auto") in PRECISIONS
    assert head_precision("w8a8") == "w8a8"
    assert head_precision("auto", "cuda") == "bfloat16"  # heads on a torch target's GPU


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle", "eagle3"])
def test_heads_move_whole_to_the_targets_device(kind):
    """Heads draft where the target's features are (`forerun profile gpu` runs them on CUDA):
    .to(device) carries every tensor a draft step reads, the target's embedding and LM rows
    too ("meta" stands in for a GPU here), without saving those rows; the KV cache follows,
    and w8a8 (fbgemm, CPU only) is refused off the CPU."""
    heads = random_heads(kind, tiny_runtime(0)).to("meta")
    assert heads.device.type == "meta"
    assert {t.device.type for t in (*heads.parameters(), *heads.buffers())} == {"meta"}
    assert not {"embed", "lm_rows", "vocab_ids"} & set(heads.state_dict())
    if kind.startswith("eagle"):
        assert {t.device.type for t in heads.new_cache(8)} == {"meta"}
    with pytest.raises(HeadError, match="CPU only"):
        heads.for_drafting("w8a8")


def test_unknown_head_precision_is_refused():
    with pytest.raises(HeadError, match="unknown head precision"):
        random_heads("medusa", tiny_runtime(0)).for_drafting("int4")
    with pytest.raises(ValueError, match="head_precision"):
        LoadConfig(head_precision="fp8")


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("tree", [0, 7])
def test_heads_without_prompt_features_equal_plain_greedy(kind, tree):
    """As on llama.cpp: a prefill without hidden states; the heads start drafting a step later
    (EAGLE's cache from the first generated token)."""
    reference = [t for s in plain_decode(tiny_runtime(0), PROMPT_T, GREEDY, 40, (),
                                         make_generator(0)) for t in s.tokens]
    target = tiny_runtime(0)
    proposer = HEAD_PROPOSERS[kind](random_heads(kind, target), target.capacity, tree, 3,
                                    prompt_features=False)
    out, steps = decode(target, proposer, 3, GREEDY, 40, make_generator(0))
    assert out == reference and steps[1].drafted == 0 and sum(s.drafted for s in steps) > 0
    if isinstance(proposer, EagleProposer):
        assert proposer.first == len(PROMPT_T)  # where its cache starts


class OracleTree:
    """Knows the greedy continuation; puts a wrong sibling first and the right token second at
    every level, so every verify step accepts a full path off the first branch."""

    name, runtime, needs, group = "oracle", None, Needs(), None

    def __init__(self, reference: list[int]):
        self.reference = reference

    def prefill(self, prompt):
        self.start = len(prompt)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        done = len(tokens) - self.start
        right = self.reference[done:done + k]
        toks, parents, parent = [], [], -1
        for t in right:
            toks += [(t + 1) % 64, t]
            parents += [parent, parent]
            parent = len(toks) - 1
        return Draft(torch.tensor(toks, dtype=torch.long), None, torch.tensor(parents))

    def commit(self, num_final):
        pass


def test_tree_verification_accepts_paths_off_the_first_branch():
    reference = [t for s in plain_decode(tiny_runtime(0), PROMPT_T, GREEDY, 30, (),
                                         make_generator(0)) for t in s.tokens]
    out, steps = decode(tiny_runtime(0), OracleTree(reference), 4, GREEDY, 30,
                        make_generator(0))
    assert out == reference
    assert [s.accepted for s in steps[1:-1]] == [4] * (len(steps) - 2)


@pytest.mark.parametrize(("kind", "tree", "sampling", "lookup"), [
    ("medusa", 6, SamplingConfig(temperature=1.0), False),
    ("eagle", 5, SamplingConfig(temperature=0.7, top_p=0.9), False),
    ("hydra", 0, SamplingConfig(temperature=1.0), False),
    ("medusa", AUTO_TREE, SamplingConfig(temperature=1.0), False),  # sized per step (flat curve)
    ("eagle", AUTO_TREE, SamplingConfig(temperature=1.0), True),  # + the prompt-lookup branch
    ("eagle", "static", SamplingConfig(temperature=1.0), False),  # tree grown as on a GPU
])
def test_sampling_with_head_trees_matches_target_joint(kind, tree, sampling, lookup):
    from conftest import tiny_runtime as rt_of

    def target():
        return rt_of(0, vocab=V, scale=0.4)

    heads = random_heads(kind, target(), scale=0.5)
    counts, generator = {}, make_generator(2024)
    for _ in range(RUNS):
        t = target()
        if tree == "static":  # static steps, the tree grown in one pass (eager here)
            proposer = EagleProposer(heads, t.capacity, 5, 2, static=True)
        elif tree == AUTO_TREE:
            proposer = HEAD_PROPOSERS[kind](heads, t.capacity, AUTO_TREE, 2,
                                            verify=lambda n: 1.0,
                                            lookup=LookupBranch() if lookup else None)
        else:
            proposer = PROPOSERS[kind](SpecConfig(kind, 2, tree=tree, tree_topk=2),
                                       ProposerContext(t, heads=heads))
        steps = speculative_decode(t, proposer, FixedK(2), PROMPT, sampling, 3, (), generator)
        seq = tuple(x for s in steps for x in s.tokens)
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_pvalue(exact_joint(sampling), counts) > ALPHA


def test_head_methods_need_matching_heads():
    rt = tiny_runtime(0)
    with pytest.raises(ValueError, match="needs trained heads"):
        PROPOSERS["eagle"](SpecConfig("eagle"), ProposerContext(rt))
    with pytest.raises(ValueError, match="holds medusa heads"):
        PROPOSERS["eagle"](SpecConfig("eagle"), ProposerContext(rt, heads=random_heads("medusa",
                                                                                      rt)))


def test_every_head_kind_has_its_proposer():
    """Each kind's method builds that kind's class (HEAD_PROPOSERS), named after the kind."""
    rt = tiny_runtime(0)
    assert set(HEAD_PROPOSERS) == set(KINDS)
    for kind in KINDS:
        heads = random_heads(kind, rt)
        proposer = PROPOSERS[kind](SpecConfig(kind), ProposerContext(rt, heads=heads))
        assert type(proposer) is HEAD_PROPOSERS[kind] and proposer.name == kind


# --- files and training -------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    rt = tiny_runtime(0)
    io = TargetIO(rt.model.embed.weight.detach(), rt.model.lm_weight().detach())
    for kind in KINDS:
        heads = random_heads(kind, rt)
        save_heads(heads, tmp_path / kind, dtype=torch.float32)
        again = load_heads(tmp_path / kind, io, context=rt.capacity)
        assert again.cfg == heads.cfg
        for (name, a), b in zip(heads.state_dict().items(), again.state_dict().values(),
                                strict=True):
            assert torch.equal(a.float(), b), name
    with pytest.raises(HeadError, match="no heads here"):
        load_heads(tmp_path / "nowhere", io)
    wide = TargetIO(torch.zeros(64, 48), torch.zeros(64, 48))
    with pytest.raises(HeadError, match="width"):
        load_heads(tmp_path / "medusa", wide)


def tiny_shards(rt, layers, n: int, length: int = 48) -> list[dict]:
    """Windows of the target's own greedy text after random prompts, teacher-forced."""
    shards, g = [], make_generator(5)
    for _ in range(n):
        prompt = torch.randint(0, 64, (4,), generator=g).tolist()
        steps = plain_decode(rt, prompt, GREEDY, length - 4, (), g)
        ids = prompt + [t for s in steps for t in s.tokens]
        shards.append(teacher(rt, ids, layers))
    return shards


@pytest.mark.parametrize("kind", KINDS)
def test_training_lowers_the_loss_and_raises_agreement(kind):
    rt = tiny_runtime(0, scale=8.0)  # sharp next-token distributions: learnable
    heads = random_heads(kind, rt, scale=0.05)
    shards = tiny_shards(rt, heads.cfg.layers, 4)
    # held_out = 0: agreement on the training windows (random targets do not generalise)
    report = train(heads, shards, TrainConfig(kind, steps=200, lr=1e-2, held_out=0),
                   progress=False)
    before, after = report["before"], report["after"]
    assert after["loss"] < 0.9 * before["loss"]
    assert after["top1"][0] > before["top1"][0]
    assert all(t5 >= t1 for t1, t5 in zip(after["top1"], after["top5"], strict=True))


def test_epochs_set_the_steps_from_the_training_windows():
    assert TrainConfig("eagle", steps=7).total_steps(10) == 7
    assert TrainConfig("eagle", steps=7, epochs=2.5).total_steps(10) == 25
    assert TrainConfig("eagle", epochs=0.01).total_steps(10) == 1
    rt = tiny_runtime(0, scale=8.0)
    heads = random_heads("medusa", rt, scale=0.05)
    shards = tiny_shards(rt, heads.cfg.layers, 4, length=16)
    # held_out 0.5: every second window held out, 2 left to train on
    report = train(heads, shards, TrainConfig("medusa", steps=999, epochs=1.5, held_out=0.5),
                   progress=False)
    assert (report["windows"], report["held_out_windows"], report["steps"]) == (2, 2, 3)


def test_corpus_vocab_takes_the_data_s_most_frequent_ids_then_the_fallback():
    w = {"tokens": torch.tensor([5, 5, 5, 9, 9, 2]), "top_ids": torch.tensor([[9], [7], [7],
                                                                            [7], [7], [1]])}
    # counts: 7 x4, 5 x3, 9 x3, 2, 1 once; special 0 always
    assert corpus_vocab([w], 3, [0, 1, 2, 3], [0]).tolist() == [0, 5, 7]
    assert corpus_vocab([w], 8, [0, 1, 2, 3, 4], [0]).tolist() == [0, 1, 2, 3, 4, 5, 7, 9]


def test_chat_prompts_are_not_benchmark_rows():
    prompts = chat_prompts()
    assert len(prompts) == len(set(prompts)) > 100 and prompts == chat_prompts()
    rows = {p.text for source in BUILTIN for p in read_workload(source)}
    assert not rows & set(prompts)


def test_collection_for_other_layers_reuses_the_chat_replies(tmp_path, monkeypatch):
    """EAGLE-3 reads other layers than EAGLE-1 on the same corpus: its collection takes the
    token windows (the slow greedy chat replies) from the EAGLE-1 one, and with one chat
    question more generates only that reply; the sibling folders are found by their manifests,
    whatever the folders are called."""
    from safetensors.torch import load_file

    from forerun.api import Engine, LoadConfig
    from forerun.train import collect, manifest, sibling_collections, write_manifest
    from forerun.train import collection as train_module

    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    cfg = TrainConfig("eagle3", max_tokens=96, seq_len=32, chat=2, chat_tokens=8)
    first = collect(engine, cfg, (-1,), tmp_path / "a", record=manifest("m", "float32", (-1,), cfg))

    class Replier:  # generates one at a time, and says which
        tokenizer, target, asked = engine.tokenizer, engine.target, []

        def generate(self, question, **kwargs):
            self.asked.append(question)
            return engine.generate(question, **kwargs)

    more = replace(cfg, chat=3, max_tokens=128)
    data, record = tmp_path / "b", manifest("m", "float32", (0, 1, -1), more)
    for name, other in (("c", replace(cfg, chat_tokens=16)), ("d", None)):
        (tmp_path / name).mkdir()  # other reply length, no manifest: not siblings
        if other is not None:
            write_manifest(tmp_path / name, manifest("m", "float32", (-1,), other))
    siblings = sibling_collections(data, record)
    assert siblings == ((tmp_path / "a", 2, False),)
    second = collect(engine, more, (0, 1, -1), data, Replier(), siblings, record)
    assert len(first) == 3 and len(second) == 4 and Replier.asked == [chat_prompts()[2]]
    for a, b in zip(first[:2], second[:2], strict=True):
        a, b = load_file(str(a)), load_file(str(b))
        assert torch.equal(a["tokens"], b["tokens"]) and set(b) >= {"h0", "h1", "h-1"}
        assert torch.allclose(a["h-1"].float(), b["h-1"].float())
    # the same features (layers) with one chat question more: the first's windows are copied,
    # the new reply's taken from the second, and only it is teacher-forced
    forced = []
    monkeypatch.setattr(train_module, "teacher", lambda *a: forced.append(a) or teacher(*a))
    data, record = tmp_path / "e", manifest("m", "float32", (-1,), more)
    third = collect(engine, more, (-1,), data, Replier(), sibling_collections(data, record))
    assert len(forced) == 1 and Replier.asked == [chat_prompts()[2]]
    for a, b in zip([*first[:2], first[2]], [*third[:2], third[3]], strict=True):
        assert a.read_bytes() == b.read_bytes()


def test_self_questions_are_the_target_s_own_and_answered_after_the_written_ones(
        tmp_path, monkeypatch):
    """--self-chat (Magpie): the target, handed its chat template opened at the user's turn,
    writes questions itself, sampled and seeded (the same twice, others with another seed),
    distinct and at least 16 characters; a collection keeps them in its data folder and
    answers them after the written questions, before the code."""
    import json

    from safetensors.torch import load_file

    from forerun.api import Engine, LoadConfig
    from forerun.train import chunked, code_corpus, collect, self_questions
    from forerun.train import collection as train_module

    monkeypatch.setattr(train_module, "SELF_MIN_ASCII", 0.0)  # a random model's bytes

    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    own = self_questions(engine, 3, seed=0, max_tokens=32)
    assert own == self_questions(engine, 3, seed=0, max_tokens=32)
    assert len(set(own)) == 3 and all(len(q) >= 16 for q in own)
    assert own != self_questions(engine, 3, seed=1, max_tokens=32)
    cfg = TrainConfig("eagle", max_tokens=32 * 4, seq_len=32, chat=1, chat_tokens=4, self_chat=2)
    data = tmp_path / "data"
    paths = collect(engine, cfg, (-1,), data)
    asked = json.loads((data / "self-questions.json").read_text())
    assert len(paths) == 4 and asked == self_questions(engine, 2, seed=cfg.seed, max_tokens=32)
    tokens = [load_file(str(p))["tokens"].tolist() for p in paths]
    for window, question in zip(tokens[:3], [chat_prompts()[0], *asked], strict=True):
        reply = engine.generate(question, max_tokens=4).token_ids
        assert window == (engine.tokenizer.encode_prompt(question) + reply)[-32:]
    assert tokens[3] == next(chunked(engine.tokenizer, code_corpus(), 32))


def test_self_tasks_wrap_the_target_s_own_passages_in_task_templates(tmp_path, monkeypatch):
    """--self-tasks: the target writes a request for a text (PASSAGE_OPENERS), answers it
    greedily (the passage), and question i is TASK_TEMPLATES[i % 6] around that passage; a
    collection keeps them and answers them after the written and the self-written questions."""
    import json

    from safetensors.torch import load_file

    from forerun.api import Engine, LoadConfig
    from forerun.train import (
        PASSAGE_OPENERS,
        TASK_TEMPLATES,
        collect,
        self_questions,
        self_tasks,
    )
    from forerun.train import collection as train_module

    monkeypatch.setattr(train_module, "SELF_MIN_ASCII", 0.0)  # a random model's bytes
    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    tasks = self_tasks(engine, 3, seed=0, request_tokens=16, passage_tokens=8)
    assert tasks == self_tasks(engine, 3, seed=0, request_tokens=16, passage_tokens=8)
    requests = self_questions(engine, 3, seed=0, max_tokens=16, openers=PASSAGE_OPENERS)
    assert all(r.startswith(PASSAGE_OPENERS) for r in requests)
    for i, (task, request) in enumerate(zip(tasks, requests, strict=True)):
        passage = engine.tokenizer.decode(engine.generate(request, max_tokens=8).token_ids)
        assert task == TASK_TEMPLATES[i % len(TASK_TEMPLATES)].format(passage=passage.strip())
    context = engine.target.config.context_length
    cfg = TrainConfig("eagle", max_tokens=32 * 4, seq_len=32, chat=1, chat_tokens=4, self_chat=1,
                      self_tasks=1)
    data = tmp_path / "data"
    paths = collect(engine, cfg, (-1,), data)
    asked = json.loads((data / "self-questions.json").read_text())
    tasked = json.loads((data / "self-tasks.json").read_text())
    assert tasked == self_tasks(engine, 1, seed=cfg.seed, request_tokens=min(64, context // 8),
                                passage_tokens=min(120, context // 4))
    tokens = [load_file(str(p))["tokens"].tolist() for p in paths]
    for window, question in zip(tokens[:3], [chat_prompts()[0], *asked, *tasked], strict=True):
        reply = engine.generate(question, max_tokens=4).token_ids
        assert window == (engine.tokenizer.encode_prompt(question) + reply)[-32:]


def test_user_questions_are_answered_after_the_target_s_own(tmp_path):
    """--questions: the user's prompts (any JSONL shape the bench reads) are answered greedily
    after the written and self-written questions, and teacher-forced like them; the bench's own
    prompt sets and a missing file are clear errors."""
    import json

    from safetensors.torch import load_file

    from forerun.api import Engine, LoadConfig
    from forerun.bench.workloads import BUILTIN, WorkloadError
    from forerun.train import collect, user_questions

    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    mine = tmp_path / "mine.jsonl"
    mine.write_text(json.dumps({"prompt": "Summarize our release notes."}) + "\n\n"
                    + json.dumps({"turns": ["Why is the build slow?", "second turn"]}) + "\n")
    assert user_questions((str(mine),)) == ("Summarize our release notes.",
                                            "Why is the build slow?")
    for bench in ("spec_bench", str(BUILTIN["editeval"])):
        with pytest.raises(ValueError, match="flatter the bench"):
            user_questions((bench,))
    with pytest.raises(WorkloadError, match="no such file"):
        user_questions((str(tmp_path / "missing.jsonl"),))
    cfg = TrainConfig("eagle", max_tokens=32 * 4, seq_len=32, chat=1, chat_tokens=4,
                      questions=(str(mine),))
    paths = collect(engine, cfg, (-1,), tmp_path / "data")
    tokens = [load_file(str(p))["tokens"].tolist() for p in paths]
    asked = [chat_prompts()[0], "Summarize our release notes.", "Why is the build slow?"]
    for window, question in zip(tokens[:3], asked, strict=True):
        reply = engine.generate(question, max_tokens=4).token_ids
        assert window == (engine.tokenizer.encode_prompt(question) + reply)[-32:]


def test_text_windows_alternate_with_the_code_after_the_chat_replies(tmp_path):
    """--text: the user's files (a folder's .txt/.md/.rst, sorted; a file as given), tokenized
    back to back into windows that alternate with the standard library's after the chat
    replies, code alone once the text runs out; a wrong path is a clear error."""
    from forerun.api import Engine, LoadConfig
    from forerun.train import chunked, code_corpus, text_files, windows

    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"), load=LoadConfig(dtype="float32"))
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.md").write_text("b" * 70)
    (docs / "sub" / "a.rst").write_text("a" * 50)
    (docs / "skip.html").write_text("<p>not text</p>")
    single = tmp_path / "notes.log"
    single.write_text("z" * 40)
    assert text_files((str(docs), str(single))) == [docs / "b.md", docs / "sub" / "a.rst",
                                                    single]
    cfg = TrainConfig("eagle", seq_len=32, chat=1, chat_tokens=4,
                      text=(str(docs), str(single)))
    got = list(itertools.islice(windows(engine, cfg), 12))
    text = engine.tokenizer.encode("b" * 70 + "a" * 50 + "z" * 40, add_special=False)
    assert len(text) == 160  # byte tokens: 5 windows of 32
    code = list(itertools.islice(chunked(engine.tokenizer, code_corpus(), 32), 6))
    assert got[1:] == [w for pair in zip([text[i:i + 32] for i in range(0, 160, 32)],
                                         code[:5], strict=True) for w in pair] + code[5:6]
    with pytest.raises(ValueError, match="no such file or folder"):
        text_files((str(tmp_path / "missing"),))
    with pytest.raises(ValueError, match=r"no \.txt/\.md/\.rst files"):
        text_files((str(target),))


def test_train_command_then_generate_with_the_heads(tmp_path):
    """`forerun train` on a tiny HF directory, then `forerun generate --heads`: identical."""
    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    env_home = {"FORERUN_HOME": str(tmp_path / "home")}
    base = [sys.executable, "-m", "forerun.cli"]
    common = ["--target", str(target), "--dtype", "float32"]
    r = subprocess.run([*base, "train", "eagle", *common, "--max-tokens", "96", "--seq-len",
                        "32", "--chat", "1", "--chat-tokens", "8", "--steps", "5",
                        "--head-vocab", "0", "--ffn-dim", "32", "--json"],
                       capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, **env_home})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.splitlines()[-1])
    out = report["out"]
    assert report["data_tokens"] == 96 and "top1" in report["after"]
    assert (tmp_path / "home" / "heads" / "target" / "eagle" / "head.safetensors").exists()
    r = subprocess.run([*base, "generate", *common, "--heads", out, "--method", "eagle",
                        "--tree", "auto", "--lookup", "--max-tokens", "12", "--raw", "--compare",
                        "--json", "hello"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["identical"] is True
    r = subprocess.run([*base, "generate", *common, "--heads", str(tmp_path), "--method",
                        "eagle", "hi"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no heads here" in r.stderr


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("tree", [0, 6, AUTO_TREE])
def test_eagle_static_steps_draft_as_the_eager_ones(kind, tree):
    """EAGLE's steps in static shapes (replayed as CUDA graphs on a GPU; eagerly here): the
    same drafts as the eager steps, step after step (catching up, padding to the next size,
    the prompt's long catch-up left eager, the tree grown on the device), and greedy output
    equal to plain. An automatic budget's device tree is grown whole before the cut (the
    eager one stops expanding nodes the budget would not carry), so there only the output
    must match."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    runs = {}
    for static in (False, True):
        target = tiny_runtime(0)
        heads = random_heads(kind, target)
        proposer = EagleProposer(heads, target.capacity, tree, 2, verify=lambda n: 1.0 + n / 64,
                                 static=static)
        assert (proposer.static is not None) == static
        drafts, propose = [], proposer.propose

        def recording(*args, propose=propose, drafts=drafts):
            draft = propose(*args)
            drafts.append((draft.tokens.tolist(), None if draft.parents is None
                           else draft.parents.tolist()))
            return draft

        proposer.propose = recording
        steps = speculative_decode(target, proposer, FixedK(5), prompt, GREEDY, 30, (),
                                   make_generator(0))
        runs[static] = ([t for s in steps for t in s.tokens], drafts)
        assert any(tokens for tokens, _ in drafts)  # the cell drafts (auto: on this curve)
        assert bool(proposer.static and proposer.static._sized) == static  # the path was taken
        assert bool(proposer.static and proposer.static.tree._shaped) == static
    assert runs[True][0] == runs[False][0]
    if tree != AUTO_TREE:
        assert runs[True][1] == runs[False][1]
    assert runs[True][0] == [t for s in plain_decode(tiny_runtime(0), prompt, GREEDY, 30, (),
                                                      make_generator(0)) for t in s.tokens]


def test_eagle_proposers_of_one_sequence_reuse_its_cache():
    """A server makes a proposer per request: an EAGLE proposer built from the same
    sequence's context (its stores) and heads takes over the last one's cache and recorded
    steps (recording CUDA graphs anew would cost every request); another sequence, or other
    heads, get their own; decoding after the hand-over still equals plain decoding."""
    target, other = tiny_runtime(0), tiny_runtime(0)
    heads = random_heads("eagle", target)
    spec = SpecConfig("eagle", 4, tree=5, tree_topk=2)
    ctx = ProposerContext(target, heads=heads)
    first = PROPOSERS["eagle"](spec, ctx)
    second = PROPOSERS["eagle"](spec, ctx)
    assert second.k_cache is first.k_cache and second.static is first.static
    assert PROPOSERS["eagle"](spec, ProposerContext(other, heads=heads)
                              ).k_cache is not first.k_cache
    assert PROPOSERS["eagle"](spec, replace(ctx, heads=random_heads("eagle", target))
                              ).k_cache is not first.k_cache
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    want = [t for s in plain_decode(tiny_runtime(0), prompt, GREEDY, 20, (), make_generator(0))
            for t in s.tokens]
    for _ in range(2):  # the second run starts from the first one's leftover cache
        proposer = PROPOSERS["eagle"](spec, ctx)
        got = [t for s in speculative_decode(target, proposer, FixedK(4), prompt, GREEDY, 20,
                                             (), make_generator(0)) for t in s.tokens]
        assert got == want


@pytest.mark.parametrize("static", [False, True])
def test_eagle_restarts_its_cache_at_a_window_after_a_rest(static):
    """A curve that wants no draft makes the head rest; the probe after a rest longer than the
    window takes in the window's features only (its cache restarts there). When the curve
    turns flat the head drafts from that cache, and greedy output equals plain decoding."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    target = tiny_runtime(0)
    steep = [True]
    proposer = EagleProposer(random_heads("eagle", target), target.capacity, AUTO_TREE, 2,
                             verify=lambda n: float(n) if steep[0] else 1.0, static=static,
                             prompt_window=4)
    got, drafted = [], 0
    for step in speculative_decode(target, proposer, FixedK(3), prompt, GREEDY, 48, (),
                                   make_generator(0)):
        got += step.tokens
        drafted += step.drafted
        if steep[0] and proposer.first > len(prompt):  # restarted after a rest
            assert proposer.committed == 4 and drafted == 0
            steep[0] = False
    assert not steep[0] and drafted > 0
    assert got == [t for s in plain_decode(tiny_runtime(0), prompt, GREEDY, 48, (),
                                           make_generator(0)) for t in s.tokens]


@pytest.mark.parametrize("static", [False, True])
def test_eagle_takes_in_a_window_of_the_prompt(static):
    """With a prompt longer than its window, EAGLE takes in the last `prompt_window` prompt
    features only (its cache starts there); greedy output still equals plain decoding."""
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    target = tiny_runtime(0)
    proposer = EagleProposer(random_heads("eagle", target), target.capacity, 5, 2,
                             static=static, prompt_window=4)
    steps = list(speculative_decode(target, proposer, FixedK(4), prompt, GREEDY, 24, (),
                                    make_generator(0)))
    assert proposer.first == proposer.hidden_from == len(prompt) - 4  # the rows it read
    assert [t for s in steps for t in s.tokens] == [
        t for s in plain_decode(tiny_runtime(0), prompt, GREEDY, 24, (), make_generator(0))
        for t in s.tokens]
