"""Layer-skip self-speculation: the target without some of its layers drafts for itself.

Properties: greedy output equals plain for every k and skip set (none skipped: the target
itself, every draft accepted); sampled output has the target's exact joint (chi-square at
ALPHA against the enumerated joint; with the check test's sampling test, this file fails by
chance with probability below 2 * ALPHA); the draft shares the target's parameter storage;
one engine and each batch member get a skipped runtime of their own; the tune search picks,
saves and finds a set; runtimes that cannot skip layers (llama.cpp) refuse clearly.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from conftest import tiny_model, tiny_runtime
from exact import Recorder, RuntimeTable, chi_square_pvalue, target_joint
from test_engine import word_tokenizer

from forerun import Engine
from forerun.check import PASS, check
from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.layer_skip import (
    LayerSkipConfig,
    default_skip,
    format_layers,
    load_tuned,
    parse_layers,
    save_tuned,
    tuned_file,
)
from forerun.reference import plain_decode
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator
from forerun.tune.layer_skip import Calibration, TuneConfig, best_k, draft_cost, search, top1

LAYERS = 6
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
MAX_NEW = 30
ALPHA = 1e-4


def target(seed: int = 0, **kw) -> TorchRuntime:
    return tiny_runtime(seed, n_layers=LAYERS, **kw)


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


GREEDY = SamplingConfig()


def decode(rt, skip, k, sampling=GREEDY, seed=0, prompt=PROMPT, max_new=MAX_NEW):
    proposer = PROPOSERS["layer-skip"](SpecConfig("layer-skip", k, skip_layers=skip),
                                       ProposerContext(rt))
    steps = list(speculative_decode(rt, proposer, FixedK(k), prompt, sampling, max_new, (),
                                    make_generator(seed)))
    return tokens_of(steps), steps, proposer


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("skip", [(), (0,), (2, 3), (1, 3, 5), (1, 2, 3, 4, 5), None])
def test_greedy_layer_skip_equals_plain(k, skip):
    rt = target()
    expected = tokens_of(plain_decode(rt, PROMPT, SamplingConfig(), MAX_NEW, (),
                                      make_generator(0)))
    got, steps, proposer = decode(rt, skip, k)
    assert got == expected
    drafted, accepted = sum(s.drafted for s in steps), sum(s.accepted for s in steps)
    assert drafted > 0
    kept = LAYERS - len(default_skip(LAYERS) if skip is None else skip)
    assert proposer.runtime.config.n_layers == kept
    if skip == ():  # the target drafting for itself: every draft token is its own choice
        assert accepted == drafted


def test_the_target_drafting_for_itself_is_accepted_when_sampling_too():
    rt = target()
    _, steps, _ = decode(rt, (), 4, SamplingConfig(temperature=1.0))
    assert sum(s.accepted for s in steps) == sum(s.drafted for s in steps) > 0


def test_the_draft_shares_the_target_weights_and_keeps_its_own_cache():
    rt = target()
    draft = rt.without_layers((1, 4))
    kept = [0, 2, 3, 5]
    assert [id(layer) for layer in draft.model.layers] == [id(rt.model.layers[i]) for i in kept]
    ours = {p.data_ptr() for p in draft.model.parameters()}
    theirs = {p.data_ptr() for p in rt.model.parameters()}
    assert ours <= theirs and len(ours) == len(theirs) - 2 * sum(
        1 for _ in rt.model.layers[1].parameters())
    assert draft.model.embed.weight.data_ptr() == rt.model.embed.weight.data_ptr()
    assert draft.model.lm_weight().data_ptr() == rt.model.lm_weight().data_ptr()
    assert draft.k_cache.shape[0] == 4 and draft.k_cache.data_ptr() != rt.k_cache.data_ptr()
    assert len(rt.model.layers) == LAYERS and rt.config.n_layers == LAYERS  # untouched
    with pytest.raises(ValueError, match="leave one"):
        rt.without_layers(range(LAYERS))
    with pytest.raises(ValueError, match="must lie in"):
        rt.without_layers((LAYERS,))


def test_skipping_nothing_computes_the_target_and_skipping_is_leaving_out():
    """The skipped model equals a model built without those layers (float64, to the bit)."""
    rt = target()
    ids = torch.tensor(PROMPT)
    same = rt.without_layers(()).forward(ids).logits
    assert torch.equal(same, rt.forward(ids).logits)
    short = tiny_model(0, n_layers=LAYERS)
    with torch.no_grad():
        del short.layers[3], short.layers[1]
    built = TorchRuntime(short.without_layers(()), capacity=64)  # without_layers: n_layers
    assert torch.equal(rt.without_layers((1, 3)).forward(ids).logits, built.forward(ids).logits)


def test_one_engine_reuses_its_skipped_runtime_and_batches_build_their_own():
    rt = target()
    engine = Engine.from_runtimes(rt, word_tokenizer(), None,
                                  SpecConfig("layer-skip", 3, skip_layers=(2, 4)))
    first = PROPOSERS["layer-skip"](engine.spec, engine.proposers).runtime
    assert PROPOSERS["layer-skip"](engine.spec, engine.proposers).runtime is first
    prompts = [PROMPT, [7, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1]]
    batch = engine.generate_batch(prompts, max_tokens=20, max_batch=3)
    for prompt, out in zip(prompts, batch, strict=True):
        alone = engine.generate(prompt, max_tokens=20)
        assert out.token_ids == alone.token_ids
        assert out.stats.drafted > 0


def test_layer_skip_passes_forerun_check():
    rt = tiny_runtime(0)  # two layers: the draft is layer 0 alone
    engine = Engine.from_runtimes(rt, word_tokenizer(), None,
                                  SpecConfig("layer-skip", 3, skip_layers=(1,)))
    prompts = [("repeats", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]), ("mixed", [1, 2, 3, 30])]
    report = check(engine, prompts, max_tokens=24, near_tie=1e-9, contexts=2, samples=300,
                   sampling=SamplingConfig(temperature=1.0), alpha=ALPHA)
    assert (report.greedy.verdict, report.sampling.verdict, report.verdict) == (PASS,) * 3
    assert any(c.drafted for c in report.sampling.contexts)


# --- sampling: the exact joint ----------------------------------------------------------------

V, K, NEW, RUNS = 3, 3, 5, 2000  # NEW = K + 2: the first draft after the prefill is K deep
SAMPLED_PROMPT = [1, 2, 0, 1, 2, 0, 1]
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_layer_skip_matches_the_target_joint(one_thread):
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). The draft (layers 1 and 2 of 4
    skipped) has its own q: accepted often, not always, so every verify path is exercised."""
    rt = tiny_runtime(5, vocab=V, n_layers=4)
    table = RuntimeTable(tiny_runtime(5, vocab=V, n_layers=4))
    spec = SpecConfig("layer-skip", K, skip_layers=(1, 2))
    ctx = ProposerContext(rt)
    generator, counts = make_generator(11), defaultdict(int)
    recorder = Recorder(PROPOSERS["layer-skip"](spec, ctx))
    accepted = drafted = 0
    for _ in range(RUNS):
        steps = list(speculative_decode(rt, recorder, FixedK(K), SAMPLED_PROMPT, SAMPLED, NEW,
                                        (), generator))
        counts[tuple(tokens_of(steps))] += 1
        accepted += sum(s.accepted for s in steps)
        drafted += sum(s.drafted for s in steps)
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert min(recorder.depths[d] for d in range(1, K + 1)) >= RUNS // 2  # deep, not one token

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


# --- the skip set: given, tuned, default -------------------------------------------------------

def test_skip_sets_parse_print_and_fail_clearly(tmp_path):
    assert parse_layers("3,5,7-9") == (3, 5, 7, 8, 9)
    assert parse_layers("") == ()
    assert format_layers((3, 5, 7, 8, 9)) == "3,5,7-9"
    saved = tmp_path / "set.json"
    saved.write_text(json.dumps({"skip": [4, 2]}))
    assert parse_layers(str(saved)) == (2, 4)
    for bad in ("3,x", "5-", "-2"):
        with pytest.raises(ValueError, match="3,5,7-12"):
            parse_layers(bad)
    with pytest.raises(ValueError, match="not a layer-skip file"):
        parse_layers(str(tmp_path / "missing.json"))
    assert default_skip(28) == (7, 9, 11, 13, 15, 17, 19)
    with pytest.raises(ValueError, match=">= 0"):
        SpecConfig("layer-skip", skip_layers=(-1,))


def test_a_runtime_that_cannot_skip_layers_refuses():
    from exact import TableModel, TableRuntime

    table = TableRuntime(TableModel(V, seed=0))  # Capabilities() as llama.cpp's: no skipping
    with pytest.raises(ValueError, match="--runtime torch"):
        PROPOSERS["layer-skip"](SpecConfig("layer-skip"), ProposerContext(table))


def test_tune_picks_a_set_saves_it_and_the_method_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    weights = tmp_path / "tiny.gguf"
    weights.write_bytes(b"stand-in for the weights file")
    rt = TorchRuntime(tiny_model(0, n_layers=LAYERS, scale=2.0), capacity=256, source=weights)
    texts = []
    for prompt in ([1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 1, 2]):
        reply = tokens_of(plain_decode(rt, prompt, SamplingConfig(), 12, (), make_generator(0)))
        texts.append((prompt, reply))
    calib = Calibration.of(texts)
    seen = []
    result = search(rt, calib, TuneConfig(max_k=4, pool=2, max_evals=14), on_trial=seen.append)
    assert len(seen) == result.evals <= 14 and result.rows == sum(len(r) + 1 for _, r in texts)
    assert [t.skip for t in result.singles] == [(i,) for i in range(LAYERS)]
    assert result.best == max(result.trials, key=lambda t: t.speedup)
    sizes = [len(t.skip) for t in result.rounds]
    assert sizes == list(range(1, len(sizes) + 1))  # one more layer a round
    assert load_tuned(weights) is None
    path = save_tuned(weights, {"skip": [1, 4], "agreement": 0.5})
    assert path == tuned_file(weights) and path.is_relative_to(tmp_path / "home")
    assert load_tuned(weights) == (1, 4)
    assert LayerSkipConfig().resolve(rt) == (1, 4)  # the tuned set, by default
    assert LayerSkipConfig((2,)).resolve(rt) == (2,)  # a given one first
    proposer = PROPOSERS["layer-skip"](SpecConfig("layer-skip"), ProposerContext(rt))
    assert proposer.runtime.config.n_layers == LAYERS - 2
    assert LayerSkipConfig().resolve(target()) == default_skip(LAYERS)  # no file: default


def test_the_packed_calibration_pass_scores_each_text_as_alone():
    rt = target()
    texts = [([1, 2, 3], [4, 5]), ([7, 8], [9, 10, 11])]
    calib = Calibration.of(texts)
    packed = top1(rt.without_layers((2,)), calib)
    alone = []
    draft = rt.without_layers((2,))
    for prompt, reply in texts:
        draft.truncate(0)
        logits = draft.forward(torch.tensor([*prompt, *reply])).logits  # [n, V]
        alone += logits[len(prompt) - 1:].argmax(-1).tolist()
    assert packed.tolist() == alone


def test_the_expected_speedup_formula():
    assert best_k(0.0, 0.5, 8) == (1, 1 / 1.5)  # nothing accepted: it does not pay
    k, speedup = best_k(1.0, 0.1, 8)  # all accepted: the longest draft
    assert k == 8 and speedup == pytest.approx(9 / 1.8)
    k, speedup = best_k(0.8, 0.5, 8)
    assert 1 <= k < 8 and speedup == pytest.approx((1 - 0.8 ** (k + 1)) / 0.2 / (k * 0.5 + 1))
    assert best_k(0.8, 0.5, 8, verify=lambda n: 1 + 0.2 * (n - 1))[1] < speedup
    rt = target()
    assert draft_cost(rt, 0) == 1.0 and 0 < draft_cost(rt, 3) < 1
