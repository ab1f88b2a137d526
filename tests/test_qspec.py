"""QSpec: the target's own weights at a lower precision draft for it.

Properties: greedy output equals plain for every k and every torch precision (int8, w8a8, int4)
on tiny float64 models; sampled output has the target's exact joint (chi-square at ALPHA against
the enumerated joint; with the check test's sampling test, this file fails by chance with
probability below 2 * ALPHA); it passes `forerun check`; the quantized copy shares the
embeddings and norms and computes what its dequantized weights do; one engine loads the draft's
weights once and each sequence (a fork, a batch member) drafts on a runtime of its own; the
requantized GGUF copy is built once, its SHA-256 checked at each use, and rebuilt when the
source changes; llama.cpp drafts (across runtimes, requantized) stay lossless on a tiny GGUF;
bad options fail clearly.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from exact import Recorder, RuntimeTable, chi_square_pvalue, target_joint
from test_engine import word_tokenizer

from forerun import Engine
from forerun.check import PASS, check
from forerun.engine import speculative_decode
from forerun.models.requantize import copy_path, requantized
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.qspec import QSpecConfig
from forerun.reference import plain_decode
from forerun.runtime.quantized import QuantLinear, quantized_runtime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

LAYERS = 4
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
MAX_NEW = 30
ALPHA = 1e-4
GREEDY = SamplingConfig()
# (bits, activation bits) -> the torch draft's precision
FORMS = {(8, 16): "int8", (8, 8): "w8a8", (4, 16): "int4"}


def tokens_of(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def spec(k: int, bits: int = 8, activations: int = 16, **kw) -> SpecConfig:
    return SpecConfig("qspec", k, qspec_runtime=kw.pop("runtime", "torch"), qspec_bits=bits,
                      qspec_activations=activations, **kw)


def decode(rt, cfg: SpecConfig, sampling=GREEDY, seed=0, prompt=PROMPT, max_new=MAX_NEW):
    proposer = PROPOSERS["qspec"](cfg, ProposerContext(rt))
    steps = list(speculative_decode(rt, proposer, FixedK(cfg.k), prompt, sampling, max_new, (),
                                    make_generator(seed)))
    return tokens_of(steps), steps, proposer


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("form", list(FORMS))
def test_greedy_qspec_equals_plain(k, form):
    rt = tiny_runtime(0, n_layers=LAYERS)
    expected = tokens_of(plain_decode(rt, PROMPT, GREEDY, MAX_NEW, (), make_generator(0)))
    got, steps, proposer = decode(rt, spec(k, *form))
    assert got == expected
    assert sum(s.drafted for s in steps) > 0 and sum(s.accepted for s in steps) > 0
    assert proposer.runtime is not rt and proposer.name == "qspec"


def test_the_copy_computes_its_dequantized_weights_and_shares_the_rest():
    rt = tiny_runtime(0, n_layers=LAYERS)
    draft = quantized_runtime(rt, "int8")
    assert draft.model.embed is rt.model.embed and draft.model.norm is rt.model.norm
    assert draft.model.layers[0].attn_norm is rt.model.layers[0].attn_norm
    assert isinstance(draft.model.layers[0].wqkv, QuantLinear)
    assert type(rt.model.layers[0].wqkv) is not QuantLinear  # the target untouched
    assert draft.k_cache.data_ptr() != rt.k_cache.data_ptr() and draft.length == 0
    w = rt.model.layers[1].w_down.weight  # [D, F]
    q = QuantLinear(w, None, "int8")
    dequantized = q.weight.float() * q.scale.float()[:, None]  # [D, F]
    assert (dequantized - w).abs().max() <= w.abs().max() / 127  # half a step, and rounding
    x = torch.randn(3, w.shape[1], dtype=torch.float64)
    expect = x.bfloat16().float() @ dequantized.T
    assert torch.allclose(q(x).float(), expect, atol=0.05 * expect.abs().max())
    assert q(x).dtype == torch.float64  # back in the activations' dtype
    w4 = rt.model.layers[1].w_gate_up.weight  # [2F, D]
    q4 = QuantLinear(w4, None, "int4")
    groups = w4.float().view(w4.shape[0], -1, 32)  # [2F, G, 32]: a step per group
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [2F, G]
    x4 = torch.randn(3, w4.shape[1], dtype=torch.float64)
    err = (q4(x4) - x4 @ w4.T).abs()  # [3, 2F]: at most half a step an input, and bf16
    bound = 0.5 * (x4.abs() @ step.repeat_interleave(32, dim=1).T.double()) + 0.02 * (
        x4.abs() @ w4.abs().T)
    assert (err <= bound).all()
    with pytest.raises(ValueError, match="multiples of"):
        QuantLinear(torch.randn(16, 48), None, "int4")


def test_one_engine_loads_the_draft_once_and_each_sequence_drafts_on_its_own():
    rt = tiny_runtime(0, n_layers=LAYERS)
    engine = Engine.from_runtimes(rt, word_tokenizer(), None, spec(3))
    first = PROPOSERS["qspec"](engine.spec, engine.proposers).runtime
    assert PROPOSERS["qspec"](engine.spec, engine.proposers).runtime is first  # its own, kept
    fork = engine.fork()
    other = PROPOSERS["qspec"](fork.spec, fork.proposers).runtime
    assert other is not first and other.model is first.model  # same weights, its own cache
    prompts = [PROMPT, [7, 7, 8, 9], [1, 2, 3, 1, 2, 3, 1]]
    batch = engine.generate_batch(prompts, max_tokens=20, max_batch=3)
    for prompt, out in zip(prompts, batch, strict=True):
        alone = engine.generate(prompt, max_tokens=20)
        assert out.token_ids == alone.token_ids
        assert out.stats.drafted > 0


def test_qspec_passes_forerun_check(one_thread):
    rt = tiny_runtime(0)
    engine = Engine.from_runtimes(rt, word_tokenizer(), None, spec(3))
    prompts = [("repeats", [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]), ("mixed", [1, 2, 3, 30])]
    report = check(engine, prompts, max_tokens=24, near_tie=1e-9, contexts=2, samples=300,
                   sampling=SamplingConfig(temperature=1.0), alpha=ALPHA)
    assert (report.greedy.verdict, report.sampling.verdict, report.verdict) == (PASS,) * 3
    assert any(c.drafted for c in report.sampling.contexts)


# --- sampling: the exact joint ----------------------------------------------------------------

V, K, NEW, RUNS = 3, 3, 5, 2000  # NEW = K + 2: the first draft after the prefill is K deep
SAMPLED_PROMPT = [1, 2, 0, 1, 2, 0, 1]
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_qspec_matches_the_target_joint(one_thread):
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). The draft (W8A8) has its own q:
    accepted often, not always, so every verify path is exercised."""
    rt = tiny_runtime(5, vocab=V, n_layers=LAYERS)
    table = RuntimeTable(tiny_runtime(5, vocab=V, n_layers=LAYERS))
    generator, counts = make_generator(11), defaultdict(int)
    recorder = Recorder(PROPOSERS["qspec"](spec(K, 8, 8), ProposerContext(rt)))
    accepted = drafted = 0
    for _ in range(RUNS):
        steps = list(speculative_decode(rt, recorder, FixedK(K), SAMPLED_PROMPT, SAMPLED, NEW,
                                        (), generator))
        counts[tuple(tokens_of(steps))] += 1
        accepted += sum(s.accepted for s in steps)
        drafted += sum(s.drafted for s in steps)
    assert 0.2 * drafted < accepted < drafted, (accepted, drafted)
    assert min(recorder.depths[d] for d in range(1, K + 1)) >= RUNS // 2  # deep, not one token

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


# --- options ----------------------------------------------------------------------------------

def test_bad_options_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="4-bit weights with 8-bit"):
        SpecConfig("qspec", qspec_bits=4, qspec_activations=8)
    with pytest.raises(ValueError, match="bits must be one of"):
        SpecConfig("qspec", qspec_bits=2)
    with pytest.raises(ValueError, match="type must be one of"):
        SpecConfig("qspec", qspec_type="Q8_0")
    with pytest.raises(ValueError, match="runtime must be one of"):
        SpecConfig("qspec", qspec_runtime="vllm")
    assert [QSpecConfig(bits=b, activations=a).precision for b, a in FORMS] == list(
        FORMS.values())
    rt = tiny_runtime(0)  # built here: no file for llama.cpp to run
    assert QSpecConfig().draft_runtime(rt) == "torch"
    with pytest.raises(ValueError, match="GGUF file"):
        PROPOSERS["qspec"](spec(3, runtime="llama.cpp"), ProposerContext(rt))
    from exact import TableModel, TableRuntime

    table = TableRuntime(TableModel(V, seed=0))  # not the torch model: nothing to quantize
    with pytest.raises(ValueError, match="--qspec-runtime llama"):
        PROPOSERS["qspec"](spec(3), ProposerContext(table))


# --- the requantized copy ---------------------------------------------------------------------

class FakeQuantizer:
    """Writes a digest of the source and the type, and counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, source, destination, qtype):
        self.calls += 1
        destination.write_bytes(hashlib.sha256(source.read_bytes()).digest() + qtype.encode())


def test_the_copy_is_built_once_checked_and_rebuilt_when_the_source_changes(tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights, version 1")
    quantize = FakeQuantizer()
    path = requantized(source, "Q2_K", quantize)
    assert path == copy_path(source, "Q2_K") and path.is_relative_to(tmp_path / "home")
    record = json.loads(path.with_suffix(".json").read_text())
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert record["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert record["type"] == "Q2_K" and quantize.calls == 1
    assert requantized(source, "Q2_K", quantize) == path and quantize.calls == 1  # kept
    stat = source.stat()  # touched, same bytes: kept, its new stamp recorded
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert requantized(source, "Q2_K", quantize) == path and quantize.calls == 1
    # a damaged copy (same size and time) fails its SHA-256 and is rebuilt
    good, stat = path.read_bytes(), path.stat()
    path.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert requantized(source, "Q2_K", quantize) == path and quantize.calls == 2
    assert path.read_bytes() == good
    source.write_bytes(b"weights, version 2")  # the source changed: a new copy
    requantized(source, "Q2_K", quantize)
    assert quantize.calls == 3
    assert json.loads(path.with_suffix(".json").read_text())["source_sha256"] == (
        hashlib.sha256(b"weights, version 2").hexdigest())
    requantized(source, "Q4_0", quantize)  # each type its own copy
    assert quantize.calls == 4 and copy_path(source, "Q4_0").is_file()
    assert not list(path.parent.glob("*.partial"))
    with pytest.raises(ValueError, match="type must be one of"):
        requantized(source, "Q8_0", quantize)


# --- llama.cpp drafts on a tiny GGUF ----------------------------------------------------------

@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from tiny_files import SPECIAL, byte_tokens, random_hf_weights, write_gguf

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    tokens = [*byte_tokens()[:-len(SPECIAL)], "ab", *SPECIAL]  # llama.cpp needs a merge
    path = tmp_path / "tiny.gguf"
    write_gguf(path, random_hf_weights(len(tokens)), tokens, merges=["a b"])
    return path


def _greedy(engine, spec_cfg=None):
    out = engine.generate(PROMPT, max_tokens=MAX_NEW, spec=spec_cfg)
    return out.token_ids, out.stats


def test_a_torch_target_drafted_by_llama_cpp_on_its_own_file_is_lossless(tiny_gguf):
    from forerun import LoadConfig

    engine = Engine(str(tiny_gguf), None, spec=SpecConfig("qspec", 3),
                    load=LoadConfig(dtype="float64", context=256))
    plain, _ = _greedy(engine, SpecConfig("none"))
    got, stats = _greedy(engine)
    assert got == plain and stats.drafted > 0
    draft = engine.proposers.stores["qspec:llama.cpp:as-is"]
    assert type(draft).__name__ == "LlamaCppRuntime" and draft.source == tiny_gguf


def test_a_llama_cpp_target_drafted_by_its_requantized_copy_is_lossless(tiny_gguf):
    from forerun import LoadConfig

    engine = Engine(str(tiny_gguf), None, spec=SpecConfig("qspec", 3, qspec_type="Q4_0"),
                    load=LoadConfig(runtime="llama.cpp", context=256))
    plain, _ = _greedy(engine, SpecConfig("none"))
    got, stats = _greedy(engine)
    assert got == plain and stats.drafted > 0
    copy = copy_path(tiny_gguf, "Q4_0")
    assert engine.proposers.stores["qspec:llama.cpp:Q4_0"].source == copy
    record = json.loads(copy.with_suffix(".json").read_text())
    assert record["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="--qspec-runtime llama"):
        engine.generate(PROMPT, max_tokens=4, spec=SpecConfig("qspec", 3, qspec_runtime="torch"))
