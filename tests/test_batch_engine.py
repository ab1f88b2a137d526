"""The batch step is lossless: every sequence of a batch gets exactly its solo output.

Properties (tiny float64 models): greedy, each member's tokens equal its own plain greedy
decoding, token for token, whatever it is batched with: plain, n-gram and draft-model members
with different k, prompt lengths and budgets in one batch, members admitted as others finish
(more sequences than the batch holds, a pool too small for all at once); every speculative
member drafted; a seeded sampled member gives the same tokens alone and in a batch; draft =
target accepts every draft token in a batch too.
"""

from __future__ import annotations

import pytest
from conftest import tiny_model

from forerun.batch_engine import Sequence, run_to_completion
from forerun.policy import POLICIES
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.draft_batch import SharedDraftModel
from forerun.reference import plain_decode
from forerun.runtime.batch import BatchTorchRuntime, PoolFull
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, make_generator

BUDGET = 1 << 20  # bytes: ~1,000 tokens of the tiny model
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [10, 20, 30, 40, 50, 60], [7, 7, 8],
           [5, 4, 3, 2, 1, 5, 4, 3, 2, 1, 5, 4], [33] * 9, [9, 19, 29, 39, 49]]


def _solo(prompt, max_new, sampling=None, seed=0):
    rt = TorchRuntime(tiny_model(0), capacity=256)
    steps = plain_decode(rt, list(prompt), sampling or SamplingConfig(), max_new, (),
                         make_generator(seed))
    return [t for s in steps for t in s.tokens]


def _batch_runtime(budget=BUDGET):
    return BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), budget)


def _member(method, k, prompt, max_new, *, policy="fixed", sampling=None, seed=0,
            draft_seed=0, noise=0.05):
    sampling = sampling or SamplingConfig()
    if method == "none":
        return Sequence(list(prompt), sampling, max_new, make_generator(seed), ())
    target = TorchRuntime(tiny_model(0), capacity=256)  # a solo view for the factories
    draft = TorchRuntime(tiny_model(draft_seed, noise=noise), capacity=256)
    spec = SpecConfig(method, k, policy)
    proposer = PROPOSERS[method](spec, ProposerContext(target, draft))
    return Sequence(list(prompt), sampling, max_new, make_generator(seed), (), proposer,
                    POLICIES[policy](spec, target, proposer.runtime), max_k=k)


def _tokens(seq):
    return [t for s in seq.steps for t in s.tokens]


MIX = [("none", 0, 0, 30), ("ngram", 4, 0, 40), ("draft", 3, 1, 25), ("draft", 5, 3, 40),
       ("ngram", 2, 4, 17), ("none", 0, 5, 12)]


@pytest.mark.parametrize("max_batch", [None, 2, 4])
def test_greedy_members_equal_their_solo_plain_output(max_batch):
    runtime = _batch_runtime()
    seqs = [_member(m, k, PROMPTS[p], n) for m, k, p, n in MIX]
    run_to_completion(runtime, seqs, max_batch=max_batch)
    for seq, (method, _k, p, n) in zip(seqs, MIX, strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n), method
        assert len(_tokens(seq)) == n
        if method != "none":
            assert sum(s.drafted for s in seq.steps) > 0, method
    assert runtime.pool.live == 0 and runtime.pool.free_slots == runtime.pool.slots


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("draft_seed", [0, 7])  # a draft that agrees often, one that rarely does
def test_greedy_equality_with_policies_and_disagreeing_drafts(policy, draft_seed):
    runtime = _batch_runtime()
    seqs = [_member("draft", k, PROMPTS[p], 30, policy=policy, draft_seed=draft_seed)
            for k, p in ((2, 0), (4, 1), (6, 2))]
    run_to_completion(runtime, seqs)
    for seq, p in zip(seqs, (0, 1, 2), strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], 30)
        assert sum(s.drafted for s in seq.steps) > 0


def test_a_small_pool_admits_sequences_as_others_finish():
    per_seq = (13 + 30 + 5) * 2 * 2 * 2 * 8 * 8  # slots x (k, v) x layers x kv heads x hd x f64
    runtime = _batch_runtime(budget=2 * per_seq)  # two sequences at a time
    seqs = [_member("ngram", 4, PROMPTS[i % 4], 30) for i in range(5)]
    run_to_completion(runtime, seqs)
    for i, seq in enumerate(seqs):
        assert _tokens(seq) == _solo(PROMPTS[i % 4], 30)
    with pytest.raises(PoolFull):  # one that never fits, with nothing running to wait for
        run_to_completion(_batch_runtime(budget=per_seq // 4), [_member("none", 0, PROMPTS[0], 30)])


def test_a_seeded_sampled_member_is_the_same_alone_and_in_a_batch():
    hot = SamplingConfig(temperature=1.0)
    alone = _member("draft", 3, PROMPTS[1], 25, sampling=hot, seed=11)
    run_to_completion(_batch_runtime(), [alone])
    crowd = [_member("ngram", 4, PROMPTS[0], 40),
             _member("draft", 3, PROMPTS[1], 25, sampling=hot, seed=11),
             _member("none", 0, PROMPTS[2], 10, sampling=SamplingConfig(temperature=0.7), seed=3)]
    run_to_completion(_batch_runtime(), crowd)
    assert _tokens(crowd[1]) == _tokens(alone)
    assert len(_tokens(alone)) == 25


def test_draft_equal_to_target_accepts_everything_in_a_batch():
    runtime = _batch_runtime()
    seqs = [_member("draft", 4, PROMPTS[p], 21, noise=0.0, sampling=SamplingConfig(t))
            for p, t in ((1, 0.0), (2, 1.0))]
    run_to_completion(runtime, seqs)
    for seq in seqs:
        verify = [s for s in seq.steps if not s.prefill]
        assert all(s.accepted == s.drafted == 4 for s in verify)
        assert len(_tokens(seq)) == 21


def test_plain_members_sample_like_plain_decoding():
    """A k = 0 member samples its tokens from p as plain decoding does (one generator draw a
    token), so a seeded plain request reproduces `plain_decode`'s own samples."""
    hot = SamplingConfig(temperature=1.0)
    seq = _member("none", 0, PROMPTS[3], 20, sampling=hot, seed=5)
    run_to_completion(_batch_runtime(), [seq, _member("ngram", 4, PROMPTS[0], 30)])
    assert _tokens(seq) == _solo(PROMPTS[3], 20, hot, seed=5)


def _shared_draft(noise=0.05, draft_seed=0):
    draft = TorchRuntime(tiny_model(draft_seed, noise=noise), capacity=256)
    return SharedDraftModel(BatchTorchRuntime(draft, BUDGET), 64)


def _pooled(shared, k, prompt, max_new, sampling=None, seed=0, policy="fixed"):
    spec = SpecConfig("draft", k, policy)
    target = TorchRuntime(tiny_model(0), capacity=256)
    proposer = shared.proposer(len(prompt) + max_new + k + 1)
    return Sequence(list(prompt), sampling or SamplingConfig(), max_new, make_generator(seed),
                    (), proposer, POLICIES[policy](spec, target, proposer.runtime), max_k=k)


@pytest.mark.parametrize("max_batch", [None, 3])
def test_a_shared_draft_model_drafts_every_member_in_one_pass_a_position(max_batch):
    shared = _shared_draft()
    calls = []
    forward = shared.runtime.forward
    shared.runtime.forward = lambda batch, *a, **kw: calls.append(batch.size) or forward(
        batch, *a, **kw)
    mix = [(2, 0, 30), (4, 1, 25), (5, 2, 40), (3, 3, 20), (4, 4, 33)]
    seqs = [_pooled(shared, k, PROMPTS[p], n, policy="adaptive" if k == 4 else "fixed")
            for k, p, n in mix]
    seqs.append(_member("ngram", 4, PROMPTS[5], 18))
    run_to_completion(_batch_runtime(), seqs, max_batch=max_batch)
    for seq, (_k, p, n) in zip(seqs, [*mix, (4, 5, 18)], strict=True):
        assert _tokens(seq) == _solo(PROMPTS[p], n)
        assert sum(s.drafted for s in seq.steps) > 0
    assert max(calls) > 1  # passes over several members
    assert shared.runtime.pool.live == 0


def test_a_shared_draft_equal_to_the_target_accepts_everything_and_reproduces_seeds():
    shared = _shared_draft(noise=0.0)
    hot = SamplingConfig(temperature=1.0)
    seqs = [_pooled(shared, 4, PROMPTS[1], 21), _pooled(shared, 4, PROMPTS[2], 21, hot, seed=9)]
    run_to_completion(_batch_runtime(), seqs)
    for seq in seqs:
        assert all(s.accepted == s.drafted == 4 for s in seq.steps if not s.prefill)
    alone = _pooled(_shared_draft(noise=0.0), 4, PROMPTS[2], 21, hot, seed=9)
    run_to_completion(_batch_runtime(), [alone])
    assert _tokens(alone) == _tokens(seqs[1])


def _engine(method="draft", k=4, policy="fixed"):
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.05), capacity=256)
    return Engine.from_runtimes(target, word_tokenizer(), draft, SpecConfig(method, k, policy))


@pytest.mark.parametrize(("method", "policy"), [("none", "fixed"), ("draft", "fixed"),
                                                ("ngram", "fixed"), ("draft", "adaptive"),
                                                ("draft", "cost")])
def test_generate_batch_equals_generate_one_at_a_time(method, policy):
    engine = _engine(method, policy=policy)
    if policy == "cost":  # a curve under which drafting pays, whatever this machine measures
        from forerun.profile import ForwardCurve

        engine.batch_curve = lambda runtime: ForwardCurve(  # a verify pass; a draft round
            (1, 1000), (0.1, 0.1) if runtime.single is engine.target else (0.001, 0.001))
    budgets = [30, 12, 25, 40]
    got = engine.generate_batch(PROMPTS[:4], max_tokens=budgets, max_batch=3)
    for prompt, budget, out in zip(PROMPTS[:4], budgets, got, strict=True):
        alone = engine.generate(prompt, max_tokens=budget)
        assert out.token_ids == alone.token_ids == _solo(prompt, budget)
        assert out.text == alone.text and out.finish_reason == alone.finish_reason
        assert out.prompt_tokens == len(prompt)
        if method != "none":
            assert out.stats.drafted > 0


def test_generate_batch_cuts_at_stop_strings_and_checks_its_arguments():
    engine = _engine("ngram")
    full = engine.generate(PROMPTS[1], max_tokens=30).text
    words = full.split(" ")
    stop = f"{words[8]} {words[9][:1]}"  # spans two tokens, ends mid-token
    alone = engine.generate(PROMPTS[1], max_tokens=30, stop=(stop,))
    out = engine.generate_batch([PROMPTS[1], PROMPTS[0]], max_tokens=30, stop=(stop,))
    assert out[0].text == alone.text == full[: full.index(stop)]
    assert out[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="per prompt, or one"):
        engine.generate_batch(PROMPTS[:2], max_tokens=[3])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.generate_batch(PROMPTS[:1], max_tokens=0)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

    root, tokens = tmp_path_factory.mktemp("batch_models"), byte_tokens()
    for name, seed in (("target", 0), ("draft", 0)):
        write_hf_dir(root / name, random_hf_weights(len(tokens), seed), tokens)
    return root


def _cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "forerun.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_batch_command_keeps_fields_and_order_and_equals_generate(tiny_dirs, tmp_path):
    import json

    models = ["--target", str(tiny_dirs / "target"), "--draft", str(tiny_dirs / "draft"),
              "--dtype", "float32", "--draft-dtype", "float32"]
    rows = [{"prompt": "Write a sort.", "id": "a"},
            {"messages": [{"role": "user", "content": "Hi there"}], "id": "b", "max_tokens": 5},
            {"prompt": "abc abc abc", "id": "c"}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    r = _cli("generate", *models, "--batch", str(tmp_path / "in.jsonl"), "--out",
             str(tmp_path / "out.jsonl"), "--max-tokens", "12", "--max-batch", "2")
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["id"] for o in out] == ["a", "b", "c"]
    assert out[1]["messages"] == rows[1]["messages"] and len(out[1]["token_ids"]) <= 5
    for o in out:
        assert {"text", "token_ids", "finish_reason", "stats"} <= o.keys()
    solo = _cli("generate", *models, "--max-tokens", "12", "--json", "Write a sort.")
    assert json.loads(solo.stdout)["token_ids"] == out[0]["token_ids"]
    assert "tok/s in all" in r.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("not json\n", "line 1: not JSON"),
    ('{"text": "x"}\n', 'expected {"prompt": TEXT}'),
    ('{"prompt": "x", "max_tokens": 0}\n', "max_tokens must be an integer >= 1"),
    ("\n", "no prompts"),
])
def test_a_bad_batch_file_is_one_clear_line(tiny_dirs, tmp_path, text, message):
    (tmp_path / "in.jsonl").write_text(text)
    r = _cli("generate", "--target", str(tiny_dirs / "target"), "--batch",
             str(tmp_path / "in.jsonl"))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
