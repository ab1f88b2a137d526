"""The lookahead method (Jacobi window + n-gram pool): its tree, its window, and losslessness.

Properties: a pass's tree gives every lookahead token exactly the paper's attention (x, level 0
up to its position, its diagonal below it) and the guesses chains from x, shared paths merged;
after a pass each diagonal's n-gram joins the pool and the window moves on (one level up, left
by the tokens accepted); the window's size follows k and, with `auto`, the verify-cost curve
(full where rows are free, none where they are dear, with probes); greedy speculative output
equals plain greedy output token for token (alone, with every shape of window; in a mixed
batch; under shadow); sampled output has the target's exact joint (chi-square); bad options
fail clearly.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from conftest import tiny_model, tiny_runtime
from exact import Recorder, TableModel, TableRuntime, chi_square_pvalue, target_joint
from test_engine import plain
from test_serve import (  # noqa: F401  (fixtures)
    NAME,
    client,
    model_dirs,
    server,
)

from forerun import Engine, LoadConfig
from forerun.batch_engine import Sequence, run_to_completion
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import Draft
from forerun.propose.lookahead import LookaheadConfig, LookaheadProposer, NgramPool, rows
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.tree import TokenTree

pytestmark = pytest.mark.usefixtures("one_thread")
REPETITIVE = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


def _proposer(window=3, ngram=4, guesses=2, auto=False, curve=None, pool_from_text=True):
    return LookaheadProposer(LookaheadConfig(window, ngram, guesses, auto, pool_from_text), curve)


def _ancestors(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


# --- the tree: the paper's attention ------------------------------------------------------------

def test_each_lookahead_token_sees_x_level_zero_before_it_and_its_diagonal():
    """W = 3, N = 4 (three levels), no guesses: token (j, i)'s path from x is level 0's tokens
    1..i, then its diagonal's tokens 1..j: the mask of the paper's figure, position t + i + j."""
    p = _proposer(window=3, ngram=4, guesses=0, pool_from_text=False)
    p.prefill([9, 9])
    p.levels = [[90, 11, 12], [20, 21, 22], [30, 31, 32]]  # distinct tokens: nothing merges
    draft = p.propose([9, 9, 7], 64, SamplingConfig(), make_generator(0))
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    assert len(tokens) == rows(3, 3, 0, 4) == 2 + 2 * 3
    for j, level in enumerate(p.levels):
        for i, token in enumerate(level):
            if (j, i) == (0, 0):
                continue  # x itself: the root
            path = [tokens[n] for n in _ancestors(parents, tokens.index(token))]
            want = [*p.levels[0][1:i + 1], *(p.levels[d][i] for d in range(1, j + 1))]
            assert path == want, (j, i)
            assert len(path) == i + j  # at position t + i + j (x at t)


def test_guesses_are_chains_from_x_merged_with_what_shares_their_path():
    p = _proposer(window=2, ngram=3, guesses=3, pool_from_text=False)
    p.prefill([4])
    p.levels = [[0, 50], [60, 51]]
    for gram in ([7, 8, 9], [7, 8, 10], [7, 60, 61]):  # the third shares (1, 0)'s path: 60
        p.pool.add(gram)
    draft = p.propose([4, 7], 64, SamplingConfig(), make_generator(0))
    tree = TokenTree.of(draft.parents, len(draft.tokens))
    paths = {tuple(draft.tokens[n].item() for n in _ancestors(draft.parents.tolist(), i))
             for i in range(len(tree))}
    # the latest min(G, w) = 2 guesses: (60, 61) is lookahead's (1, 0) and a guess, one node
    assert paths == {(60,), (60, 61), (8,), (8, 10), (50,), (50, 51)}
    assert len(draft.tokens) == 6


def test_after_a_pass_each_diagonal_is_an_ngram_and_the_window_moves_up():
    p = _proposer(window=3, ngram=3, guesses=0, pool_from_text=False)
    p.prefill([5, 6])
    p.levels = [[0, 11, 12], [20, 21, 22]]
    draft = p.propose([5, 6, 7], 64, SamplingConfig(), make_generator(0))
    nodes = {t: n for n, t in enumerate(draft.tokens.tolist())}
    best = [0] * (len(draft.tokens) + 1)
    for i, token in enumerate((20, 21, 22)):  # the argmax after each top-level token
        best[nodes[token] + 1] = 40 + i
    p.observe(draft, best, [])  # nothing accepted
    assert p.pool.grams == {7: [(20, 40)], 11: [(21, 41)], 12: [(22, 42)]}
    assert p.levels == [[20, 21, 22], [40, 41, 42]]
    # accepted tokens move every level left by as many (the gap filled from the text)
    draft = p.propose([5, 6, 7, 99], 64, SamplingConfig(), make_generator(0))
    p.observe(draft, [3] * (len(draft.tokens) + 1), [0])
    assert p.levels[0][:2] == [41, 42] and p.levels[1][:2] == [3, 3]
    assert all(len(level) == 3 for level in p.levels)


def test_the_window_fills_one_level_a_pass_before_it_collects():
    p = _proposer(window=2, ngram=4, guesses=0, pool_from_text=False)
    p.prefill([1, 2, 3])
    p.levels = [[0, 9]]
    for passes, n_levels in enumerate((1, 2, 3, 3)):
        assert len(p.levels) == n_levels
        assert bool(p.pool.grams) == (passes == 3)  # after the first pass with all levels
        draft = p.propose([1, 2, 3], 64, SamplingConfig(), make_generator(0))
        assert len(draft.tokens) == rows(2, n_levels, 0, 4)
        p.observe(draft, [10 * n_levels + r for r in range(len(draft.tokens) + 1)], [])
    assert p.pool.grams  # collected once the levels were full


def test_a_draft_the_engine_cut_teaches_nothing_and_breaks_nothing():
    p = _proposer(window=3, ngram=3, guesses=0, pool_from_text=False)
    p.prefill([5, 6])
    draft = p.propose([5, 6, 7], 64, SamplingConfig(), make_generator(0))
    cut = draft.fit(2)
    p.observe(cut, [1, 1, 1], [])
    assert not p.pool.grams and len(p.levels) == 2


def test_the_pool_keeps_the_latest_distinct_guesses_per_key():
    pool = NgramPool(3, 2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7]):
        pool.add(gram)
    assert pool.guesses(1, 5) == [(6, 7), (2, 3)]
    pool.add_text([9, 8, 7, 9, 8, 6], 0)
    assert pool.guesses(9, 2) == [(8, 6), (8, 7)] and pool.guesses(8, 1) == [(7, 9)]


# --- sizing ------------------------------------------------------------------------------------

def test_k_caps_the_rows_a_pass_adds():
    p = _proposer(window=5, ngram=4, guesses=0, pool_from_text=False)
    p.prefill(list(range(20)))
    p.levels = [list(range(100, 105)), list(range(110, 115)), list(range(120, 125))]
    for k in (0, 1, 2, 4, 7, 12, 100):
        draft = p.propose(list(range(20)), k, SamplingConfig(), make_generator(0))
        assert len(draft.tokens) <= k
        p._made = None
    assert len(draft.tokens) == rows(5, 3, 0, 4)


def test_auto_takes_the_whole_window_where_rows_are_free_and_none_where_dear():
    free = _proposer(window=4, ngram=3, guesses=2, auto=True, curve=lambda n: 1.0)
    free.prefill(REPETITIVE)
    assert len(free.propose(REPETITIVE, 64, SamplingConfig(), make_generator(0)).tokens) == \
        rows(4, 1, 1, 3)  # the whole window (one level yet), the text's one guess after 3
    dear = _proposer(window=4, ngram=3, guesses=2, auto=True, curve=lambda n: float(n))
    dear.prefill(REPETITIVE)
    sizes = []
    for _ in range(20):  # a plain pass each time, but a probe (w = 1) every 8th
        draft = dear.propose(REPETITIVE, 64, SamplingConfig(), make_generator(0))
        sizes.append(len(draft.tokens))
        if len(draft.tokens):
            dear.observe(draft, [0] * (len(draft.tokens) + 1), [])  # the probe gains nothing
    assert sizes.count(0) >= 18 and 0 < max(sizes) <= rows(1, 2, 2, 3)


# --- greedy: speculative == plain --------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5, 4, 5), (3, 2, 2), (4, 5, 0), (1, 3, 3), (6, 3, 6)])
@pytest.mark.parametrize("prompt", [REPETITIVE, [10, 20, 30, 40, 50, 60], [5, 5, 5, 5]])
def test_greedy_lookahead_equals_plain(shape, prompt):
    proposer = Recorder(_proposer(*shape))
    steps = list(speculative_decode(tiny_runtime(0), proposer, FixedK(64), list(prompt),
                                    SamplingConfig(), 60, (), make_generator(0)))
    assert [t for s in steps for t in s.tokens] == plain(prompt=prompt, max_new=60)
    if shape[0] > 1:
        assert max(proposer.depths) >= 2  # real trees, several deep
    if shape[2]:
        assert len(steps) < 60  # it accepted something


def test_greedy_lookahead_through_the_registry_with_auto_sizing(synthetic_curves):
    target = tiny_runtime(0)
    synthetic_curves(target, per_token=0.0)  # a flat curve: rows free
    spec = SpecConfig("lookahead", 40, lookahead_window=4, lookahead_guesses=4)
    proposer = PROPOSERS["lookahead"](spec, ProposerContext(target))
    assert proposer.curve is not None
    steps = list(speculative_decode(target, proposer, FixedK(40), REPETITIVE, SamplingConfig(),
                                    60, (), make_generator(0)))
    assert [t for s in steps for t in s.tokens] == plain(prompt=REPETITIVE, max_new=60)
    assert len(steps) < 55


def test_shadow_lookahead_emits_plains_tokens_one_a_pass():
    steps = list(speculative_decode(tiny_runtime(0), _proposer(4, 3, 4), FixedK(64), REPETITIVE,
                                    SamplingConfig(), 40, (), make_generator(0), shadow=True))
    assert [t for s in steps for t in s.tokens] == plain(prompt=REPETITIVE, max_new=40)
    assert all(len(s.tokens) == 1 for s in steps) and sum(s.accepted for s in steps) > 0


def test_lookahead_members_of_a_mixed_batch_equal_their_plain_output():
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 20)
    solo = TorchRuntime(tiny_model(0), capacity=256)

    def member(prompt, max_new, method="lookahead", k=24):
        spec = SpecConfig(method, k, lookahead_auto=False, lookahead_window=3)
        proposer = PROPOSERS[method](spec, ProposerContext(solo))
        return Sequence(list(prompt), SamplingConfig(), max_new, make_generator(0), (), proposer,
                        FixedK(k), max_k=k)

    seqs = [member(REPETITIVE, 40), member([10, 20, 30], 30), member([7, 7, 8], 25, "ngram", 4),
            Sequence([3, 1, 4], SamplingConfig(), 20, make_generator(0), ()),
            member([5, 4, 3, 5, 4, 3], 35, k=5)]  # k = 5: a small window
    run_to_completion(runtime, seqs, max_batch=3)
    for s in seqs:
        assert [t for st in s.steps for t in st.tokens] == plain(prompt=s.prompt,
                                                                 max_new=s.max_new_tokens)
    assert sum(st.accepted for st in seqs[0].steps) > 0


# --- through the server ------------------------------------------------------------------------

def test_a_server_request_for_lookahead_is_plains_text(server, model_dirs):  # noqa: F811
    """The real `openai` client, streamed and not: a lookahead request's text is plain's, and
    its passes drafted (the server's batch verifies its trees beside other requests)."""
    engine = Engine(str(model_dirs[0]), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float64"))
    prompt = "abcabcabcabc"
    want = engine.generate(engine.tokenizer.encode_prompt(prompt, raw=True), max_tokens=24)
    c = client(server)
    speculation = {"method": "lookahead", "k": 16, "stream_stats": True}
    out = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                               extra_body={"speculation": speculation})
    assert out.choices[0].text == want.text
    assert out.choices[0].model_extra["speculation"]["drafted"] > 0
    chunks = c.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  stream=True, extra_body={"speculation": speculation})
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text


def test_a_server_request_for_lookahead_keeps_the_servers_lookahead_options():
    from forerun.serve.app import resolve_spec
    from forerun.serve.protocol import Speculation

    flags = SpecConfig("ngram", 4, lookahead_window=3, lookahead_ngram=5, lookahead_guesses=2,
                       lookahead_auto=False)
    spec, _ = resolve_spec(Speculation(method="lookahead", k=16), flags, has_draft=False)
    assert (spec.method, spec.k, spec.lookahead()) == ("lookahead", 16, flags.lookahead())


# --- sampling: the target's exact joint --------------------------------------------------------

V, ALPHA, RUNS, NEW = 3, 1e-4, 2000, 6
SAMPLED_PROMPT = [1, 1, 2, 1, 0, 2, 2, 1, 1, 2, 1, 2, 1, 0, 1]
TEMPERATURE = SamplingConfig(temperature=1.0)
TARGET = TableModel(V, seed=3)


def test_sampled_lookahead_drafts_match_the_target_joint():
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). One proposer for every run (its window
    and its fill's random state carry over, its pool starts anew with each prompt): a run's
    drafts depend on earlier runs and on its own earlier tokens, never on its pass's draws, so
    every run is an exact draw from the target's joint. Its drafts are trees (a window of up to
    3 over 2 levels beside up to 3 guesses from the prompt's n-grams), verified by recursive
    rejection with one-hot proposals. Measured: 3,448 nodes 2 deep and 4,896 1 deep in 2,000
    runs."""
    target = TableRuntime(TARGET)
    proposer = Recorder(_proposer(window=3, ngram=3, guesses=3))
    generator, counts = make_generator(11), defaultdict(int)
    for _ in range(RUNS):
        steps = speculative_decode(target, proposer, FixedK(32), SAMPLED_PROMPT, TEMPERATURE,
                                   NEW, (), generator)
        counts[tuple(t for s in steps for t in s.tokens)] += 1
    # trees, 2 deep in every run (NEW caps a pass's rows: k <= the tokens left - 1)
    assert proposer.depths[2] >= RUNS and proposer.depths[1] > proposer.depths[2], \
        proposer.depths

    def row(prefix):
        return logits_to_probs(TARGET.logits((*SAMPLED_PROMPT, *prefix)), TEMPERATURE)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


# --- options -----------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    (dict(lookahead_window=0), "window >= 1"), (dict(lookahead_ngram=1), "ngram >= 2"),
    (dict(lookahead_guesses=-1), "guesses >= 0")])
def test_bad_lookahead_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig("lookahead", 16, **options)


def test_lookahead_cannot_join_multi():
    with pytest.raises(ValueError, match="lookahead cannot join"):
        SpecConfig("multi", 4, multi_methods=("ngram", "lookahead"))


def test_the_cli_exposes_the_lookahead_options():
    import argparse

    from forerun.commands.options import add_spec_args, spec_config

    p = argparse.ArgumentParser()
    add_spec_args(p)
    spec = spec_config(p.parse_args(["--method", "lookahead", "-k", "30", "--lookahead-window",
                                     "4", "--lookahead-ngram", "3", "--lookahead-guesses", "2",
                                     "--lookahead-fixed"]))
    assert spec.lookahead() == LookaheadConfig(4, 3, 2, auto=False)


def test_an_empty_draft_needs_no_observation():
    p = _proposer()
    p.prefill([1, 2])
    draft = p.propose([1, 2, 3], 0, SamplingConfig(), make_generator(0))
    assert draft.tokens.numel() == 0
    p.observe(Draft.empty(), [0], [])  # (the engine does not call it then; harmless anyway)
    assert torch.equal(draft.tokens, Draft.empty().tokens)
