"""The llama.cpp runtime behind the Runtime protocol: chunked and token-by-token forwards agree,
rollback reproduces logits, limits hold, bad input fails clearly, and greedy speculative decoding
on it equals plain greedy decoding on it exactly."""

import gc
import json
import sys

import pytest
import torch
from tiny_files import SPECIAL, byte_tokens, random_hf_weights, write_gguf, write_hf_dir

from forerun import Engine, LoadConfig, SpecConfig
from forerun.models.catalog import ModelError
from forerun.models.load import open_model

pytest.importorskip("llama_cpp")
from forerun.runtime.llama_cpp import LlamaCppRuntime

real = pytest.mark.real
SMOL = "smollm2-135m-instruct"
CONTEXT = 512
PROMPT = "Write a Python function that checks whether a string is a palindrome."
PROMPTS = [  # (prompt, raw): a chat request, and a raw code continuation that copies a lot
    (PROMPT, False),
    ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
     "        self.items.append(x)\n\n", True),
]
MAX_TOKENS = 48
# Greedy losslessness is exact: with the patched kernels (make install; the x86 patches) a
# k+1-token verify pass and a 1-token plain pass give a row the same bits (README: "Lossless on
# llama.cpp"), so speculative greedy output must equal plain's token for token.
LOGIT_ATOL = 0.1  # chunked vs token-by-token forwards (the README measures 0.0 on this model)


@pytest.fixture(scope="module")
def smol():
    return open_model(SMOL)


@pytest.fixture(scope="module")
def runtime(smol):
    return smol.load(runtime="llama.cpp", context=CONTEXT)


@pytest.fixture(scope="module")
def prompt_ids(smol):
    return torch.tensor(smol.tokenizer.encode_prompt(PROMPT))


def one_by_one(rt, ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([rt.forward(ids[i:i + 1]).logits for i in range(ids.shape[0])])  # [T, V]


@real
def test_chunk_equals_token_by_token(runtime, prompt_ids):
    runtime.truncate(0)
    chunk = runtime.forward(prompt_ids).logits  # [T, V]
    runtime.truncate(0)
    single = one_by_one(runtime, prompt_ids)
    assert chunk.shape == single.shape == (len(prompt_ids), runtime.config.vocab_size)
    assert chunk.dtype == torch.float32
    assert torch.equal(chunk.argmax(-1), single.argmax(-1))
    assert torch.allclose(chunk, single, atol=LOGIT_ATOL, rtol=0)


@real
def test_truncate_then_forward_reproduces_logits(runtime, prompt_ids):
    runtime.truncate(0)
    full = runtime.forward(prompt_ids).logits
    cut = len(prompt_ids) // 2
    runtime.truncate(cut)
    assert runtime.length == cut
    again = runtime.forward(prompt_ids[cut:]).logits
    assert torch.allclose(again, full[cut:], atol=LOGIT_ATOL, rtol=0)
    runtime.truncate(cut)  # a wrong token, rolled back, leaves no trace
    runtime.forward(torch.tensor([7, 8, 9]))
    runtime.truncate(cut)
    assert torch.allclose(runtime.forward(prompt_ids[cut:]).logits, again, atol=1e-5, rtol=0)


@real
def test_length_capacity_last_only_and_limits(runtime, prompt_ids):
    runtime.truncate(0)
    assert runtime.capacity == CONTEXT
    out = runtime.forward(prompt_ids, last_only=True, hidden_layers=(-1,))
    assert runtime.length == len(prompt_ids)
    assert out.logits.shape == (1, runtime.config.vocab_size)
    # every row's hidden state, even under last_only: an EAGLE head's prefill needs them all
    assert out.hidden[-1].shape == (len(prompt_ids), runtime.config.dim)
    with pytest.raises(ValueError, match="cannot truncate"):
        runtime.truncate(runtime.length + 1)
    with pytest.raises(ValueError, match="context full"):
        runtime.forward(torch.zeros(CONTEXT, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids"):
        runtime.forward(torch.tensor([runtime.config.vocab_size]))
    with pytest.raises(NotImplementedError, match="layer -1"):
        runtime.forward(prompt_ids[:1], hidden_layers=(0,))
    with pytest.raises(ValueError, match="ancestor mask"):
        runtime.forward(prompt_ids[:2], tree_mask=torch.ones(2, 2, dtype=torch.bool))
    assert runtime.length == len(prompt_ids)  # failed calls change nothing


@real
def test_long_forward_is_chunked_past_the_batch_size(smol, runtime, prompt_ids):
    small = LlamaCppRuntime(smol.path, smol.config, CONTEXT, batch=8)
    chunked = small.forward(prompt_ids).logits
    runtime.truncate(0)
    whole = runtime.forward(prompt_ids).logits
    assert torch.allclose(chunked, whole, atol=LOGIT_ATOL, rtol=0)
    small.truncate(0)
    last = small.forward(prompt_ids, last_only=True).logits
    assert torch.allclose(last, whole[-1:], atol=LOGIT_ATOL, rtol=0)


def test_hf_directory_with_llama_cpp_fails_clearly(tmp_path):
    tokens = byte_tokens()
    write_hf_dir(tmp_path / "hf", random_hf_weights(len(tokens)), tokens)
    with pytest.raises(ModelError, match="runs GGUF files"):
        open_model(str(tmp_path / "hf")).load(runtime="llama.cpp")


def test_forks_share_the_model_and_hold_sequences_of_their_own(tmp_path):
    """The server decodes several requests in turn, one fork each; a fork outlives the
    runtime it came from (the model is freed with the last context using it)."""
    tokens = [*byte_tokens()[:-len(SPECIAL)], "ab", *SPECIAL]  # llama.cpp needs a merge
    write_gguf(tmp_path / "tiny.gguf", random_hf_weights(len(tokens)), tokens, merges=["a b"])
    src = open_model(str(tmp_path / "tiny.gguf"))
    first = src.load(runtime="llama.cpp", context=64)
    second = first.fork()
    x, y, last = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([9, 8, 7]), torch.tensor([6])
    first.forward(x)
    second.forward(y)
    first_next = first.forward(last).logits
    del first
    gc.collect()
    second_next = second.forward(last).logits
    alone = src.load(runtime="llama.cpp", context=64)
    want = alone.forward(torch.cat([x, last])).logits[-1:]
    assert torch.allclose(first_next, want, atol=1e-4)
    alone.truncate(0)
    want = alone.forward(torch.cat([y, last])).logits[-1:]
    assert torch.allclose(second_next, want, atol=1e-4) and second.length == 4


def test_greedy_many_equals_one_prompt_at_a_time(tmp_path):
    """Training data's batched replies: 5 prompts through 2 rows (a finished row takes the next
    prompt) give each prompt's plain greedy reply, cut before a stop token."""
    tokens = [*byte_tokens()[:-len(SPECIAL)], "ab", *SPECIAL]
    write_gguf(tmp_path / "tiny.gguf", random_hf_weights(len(tokens)), tokens, merges=["a b"])
    rt = open_model(str(tmp_path / "tiny.gguf")).load(runtime="llama.cpp", context=64)
    prompts = [[1, 2, 3], [7], [4, 4, 4, 4, 9, 10], [30, 31], [5, 6, 7, 8]]

    def plain(prompt: list[int], n: int) -> list[int]:
        rt.truncate(0)
        out = [int(rt.forward(torch.tensor(prompt), last_only=True).logits[-1].argmax())]
        while len(out) < n:
            out.append(int(rt.forward(torch.tensor(out[-1:])).logits[-1].argmax()))
        return out

    full = [plain(p, 6) for p in prompts]
    stop = {full[0][2]}  # ends the first reply after two tokens, maybe others too
    want = {i: r[:next((j for j, t in enumerate(r) if t in stop), len(r))]
            for i, r in enumerate(full)}
    got = list(rt.greedy_many(prompts, 6, stop, rows=2))
    assert dict(got) == want and sorted(i for i, _ in got) == list(range(5))
    assert len(want[0]) == 2 and rt.length == len(prompts[-1]) + 5  # its own context untouched
    with pytest.raises(ValueError, match="fit"):
        list(rt.greedy_many([[1, 2]], rt.config.context_length, stop))
    # sampled (the target writing its own questions): each prompt's own seeded generator, so
    # what it gets does not depend on how the rows were shared; another seed, other replies
    sampled = dict(rt.greedy_many(prompts, 6, set(), rows=2, temperature=1.0, seed=3))
    assert sampled == dict(rt.greedy_many(prompts, 6, set(), rows=3, temperature=1.0, seed=3))
    assert sampled != dict(rt.greedy_many(prompts, 6, set(), rows=2, temperature=1.0, seed=4))
    assert all(len(r) == 6 for r in sampled.values())


def test_unknown_runtime_and_missing_package_fail_clearly(tmp_path, monkeypatch):
    tokens = byte_tokens()
    write_gguf(tmp_path / "tiny.gguf", random_hf_weights(len(tokens)), tokens)
    src = open_model(str(tmp_path / "tiny.gguf"))
    with pytest.raises(ModelError, match="unknown runtime"):
        src.load(runtime="onnx")
    monkeypatch.setitem(sys.modules, "forerun.runtime.llama_cpp", None)
    with pytest.raises(ModelError, match=r"pip install 'forerun\[llama\]'"):
        src.load(runtime="llama.cpp")


# --- greedy losslessness ------------------------------------------------------------------------

def plain_top2_gap(rt, prompt: list[int], out: list[int], i: int) -> float:
    """The plain run's top-2 logit gap for out[i]: prompt, then out[:i] one token per pass."""
    rt.truncate(0)
    logits = rt.forward(torch.tensor(prompt), last_only=True).logits
    for token in out[:i]:
        logits = rt.forward(torch.tensor([token])).logits
    top = logits[-1].topk(2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module")
def engine(smol, runtime):
    draft = smol.load(runtime="llama.cpp", context=CONTEXT)
    return Engine.from_runtimes(runtime, smol.tokenizer, draft)


@real
@pytest.mark.parametrize(("prompt", "raw"), PROMPTS)
def test_speculative_greedy_equals_plain_exactly(engine, prompt, raw):
    """With the patched kernels a verify pass gives every row the bits a one-token pass gives
    it, so greedy speculative output is plain's token for token, and the model as its own
    draft has every draft token accepted. A difference is a failure, reported with plain's
    top-2 logit gap there (a near-tie would say the kernels are not row-invariant here)."""
    ids = engine.encode(prompt, raw)
    plain = engine.generate(ids, max_tokens=MAX_TOKENS, spec=SpecConfig("none")).token_ids
    assert len(plain) == MAX_TOKENS
    for spec in (SpecConfig("ngram", 4), SpecConfig("draft", 4)):
        out = engine.generate(ids, max_tokens=MAX_TOKENS, spec=spec)
        if out.token_ids != plain:
            i = next((j for j, (a, b) in enumerate(zip(plain, out.token_ids, strict=False))
                      if a != b), min(len(plain), len(out.token_ids)))
            gap = plain_top2_gap(engine.target, ids, plain, i) if i < len(plain) else None
            pytest.fail(f"{spec.method}: differs from plain at token {i} (plain's top-2 logit "
                        f"gap there: {gap})")
        assert out.stats.drafted > 0, spec  # it speculated (n-gram: the prompts repeat)
    # the same model as its own draft: the same bits, so every draft token is accepted
    assert out.stats.acceptance_rate == 1.0


@real
def test_engine_loads_llama_cpp_by_name():
    engine = Engine(SMOL, SMOL, spec=SpecConfig("draft", 4),
                    load=LoadConfig(runtime="llama.cpp", context=CONTEXT))
    assert isinstance(engine.target, LlamaCppRuntime) and isinstance(engine.draft, LlamaCppRuntime)
    out = engine.generate(PROMPT, max_tokens=8)
    assert len(out.token_ids) == 8 and out.stats.accepted > 0


def test_forward_curve_is_cached_on_disk_per_file_build_and_machine(runtime, tmp_path,
                                                                   monkeypatch):
    """A llama.cpp runtime's calibrated curve outlives the process: a new runtime on the same
    file finds it in $FORERUN_HOME/curves without measuring; a changed file, an expired or a
    too-short curve, a rebuilt llama.cpp and FORERUN_CURVE_CACHE=0 measure again."""
    import os
    import time

    import forerun.profile as profile

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path))
    monkeypatch.setenv("FORERUN_CURVE_CACHE", "1")
    measured = []
    real_measure = profile.measure_forward_curve
    monkeypatch.setattr(profile, "measure_forward_curve",
                        lambda rt, sizes, **kw: measured.append(sizes) or real_measure(
                            rt, sizes, reps=1, warmup=0))

    first = profile.calibrated_curve(runtime.fork(), 2)
    assert len(measured) == 1 and len(list((tmp_path / "curves").glob("*.json"))) == 1
    assert profile.calibrated_curve(runtime.fork(), 2).base == first.base  # another one: disk
    assert len(measured) == 1
    profile.calibrated_curve(runtime.fork(), 3)  # longer than the cached one
    assert len(measured) == 2
    [cached] = (tmp_path / "curves").glob("*.json")
    saved = json.loads(cached.read_text())
    cached.write_text(json.dumps({**saved, "measured": time.time() - profile.CURVE_MAX_AGE_S}))
    profile.calibrated_curve(runtime.fork(), 2)  # expired
    assert len(measured) == 3
    stat = runtime._path.stat()
    os.utime(runtime._path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    try:
        profile.calibrated_curve(runtime.fork(), 2)  # the file changed: another key
        assert len(measured) == 4
    finally:
        os.utime(runtime._path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    import forerun.runtime.llama_cpp as llama_cpp_runtime

    stamp = llama_cpp_runtime._library_stamp()
    assert stamp  # the libraries of the llama-cpp-python in use
    monkeypatch.setattr(llama_cpp_runtime, "_library_stamp", lambda: [*stamp, ["new.so", 1, 2]])
    profile.calibrated_curve(runtime.fork(), 2)  # llama.cpp rebuilt: another key
    assert len(measured) == 5
    monkeypatch.setenv("FORERUN_CURVE_CACHE", "0")
    profile.calibrated_curve(runtime.fork(), 2)
    assert len(measured) == 6 and len(list((tmp_path / "curves").glob("*.json"))) == 3


def test_library_stamp_changes_with_a_rebuilt_library(tmp_path):
    """The curve cache's build key: each library file's name, size and mtime; links skipped."""
    import os

    from forerun.runtime.llama_cpp import _library_stamp

    lib = tmp_path / "libggml-cpu.so.0.25.3"
    lib.write_bytes(b"x" * 10)
    (tmp_path / "libggml-cpu.so.0").symlink_to(lib.name)
    first = _library_stamp(tmp_path)
    assert [name for name, *_ in first] == [lib.name]
    os.utime(lib, ns=(0, lib.stat().st_mtime_ns + 1))
    assert _library_stamp(tmp_path) != first
    assert _library_stamp(tmp_path / "missing") == []


@real
def test_invariant_kernels_are_a_torch_option(tmp_path):
    with pytest.raises(ModelError, match="torch runtime"):
        Engine(SMOL, None, spec=SpecConfig("none"),
               load=LoadConfig(runtime="llama.cpp", context=CONTEXT, invariant=True))
    target = tmp_path / "target"
    write_hf_dir(target, random_hf_weights(len(byte_tokens()), seed=0), byte_tokens())
    engine = Engine(str(target), None, spec=SpecConfig("none"),
                    load=LoadConfig(dtype="float32", invariant=True))
    assert engine.target.invariant == engine.target.prepacked  # on where the kernels apply
