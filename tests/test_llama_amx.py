"""The AMX decision for llama.cpp: overrides, models with nothing to repack, the cache, and the
child probe on a real quantized model (it must run cleanly and agree with the plain kernels on
every machine with our build: on AMX CPUs the tiles, elsewhere the AVX repack); and, on AMX
CPUs, the patch's fused multi-row VNNI kernels give the one-row kernel's logits to the bit."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tiny_files import SPECIAL, byte_tokens, random_hf_weights, random_kquant_weights, write_gguf

from forerun.models.load import open_model
from forerun.runtime import llama_amx

pytest.importorskip("llama_cpp")


@pytest.fixture
def amx_cpu(monkeypatch, tmp_path):
    """An AMX CPU, a fresh FORERUN_HOME, no override, and a probe that counts its calls."""
    monkeypatch.setattr(llama_amx, "cpu_has_amx", lambda: True)
    monkeypatch.setenv("FORERUN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(llama_amx.ENV, raising=False)
    calls = []

    def probe(model):
        calls.append(model)
        return {"ok": False, "why": "test"}

    monkeypatch.setattr(llama_amx, "probe", probe)
    return calls


@pytest.fixture(scope="module")
def float32_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    tokens = byte_tokens()
    write_gguf(path, random_hf_weights(len(tokens)), tokens)
    return path


def test_cpus_without_amx_keep_the_repack_buffers(monkeypatch, float32_gguf):
    monkeypatch.setattr(llama_amx, "cpu_has_amx", lambda: False)
    monkeypatch.setenv(llama_amx.ENV, "off")
    assert llama_amx.use_extra_buffers(float32_gguf)


@pytest.mark.parametrize(("setting", "expected"), [("on", True), ("off", False), ("0", False)])
def test_the_environment_overrides_the_probe(amx_cpu, monkeypatch, float32_gguf, setting,
                                             expected):
    monkeypatch.setenv(llama_amx.ENV, setting)
    assert llama_amx.use_extra_buffers(float32_gguf) is expected
    assert amx_cpu == []


def test_a_model_without_amx_tensors_needs_no_probe(amx_cpu, float32_gguf):
    assert llama_amx.use_extra_buffers(float32_gguf)
    assert amx_cpu == []


def test_the_verdict_is_cached_per_library_and_model(amx_cpu, monkeypatch, float32_gguf,
                                                     tmp_path):
    monkeypatch.setattr(llama_amx, "_has_amx_tensors", lambda model: True)
    assert not llama_amx.use_extra_buffers(float32_gguf)
    assert not llama_amx.use_extra_buffers(float32_gguf)
    assert amx_cpu == [float32_gguf]  # probed once
    cache = json.loads((tmp_path / "home" / llama_amx.CACHE_FILE).read_text())
    (key, verdict), = cache.items()
    assert str(float32_gguf.resolve()) in key and verdict == {"ok": False, "why": "test"}


@pytest.mark.real
def test_the_probe_passes_on_a_real_quantized_model():
    """SmolLM2 Q4_1: AMX-capable tensors. A build without the patch fails here on AMX CPUs
    (SIGSEGV or SIGILL in the child), and forerun then keeps llama.cpp's plain kernels."""
    path = open_model("smollm2-135m-instruct").path
    assert llama_amx._has_amx_tensors(path)
    verdict = llama_amx.probe(path)
    assert verdict["ok"], verdict["why"]


PASSES = (2, 3, 5, 9, 12, 13, 25, 33)  # tokens a pass: one fused group, two, three; tiles
CHILD = """
import sys, numpy as np, torch
from forerun.models.load import open_model
rt = open_model(sys.argv[1]).load(runtime="llama.cpp", context=128)
rt.forward(torch.arange(3, 23), last_only=True)
out = {}
for n in map(int, sys.argv[3:]):
    rt.truncate(20)
    out[str(n)] = rt.forward(torch.arange(40, 40 + n)).logits.numpy()
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(not llama_amx.cpu_has_amx(), reason="the AMX kernels run on AMX CPUs only")
def test_fused_vnni_rows_give_the_one_row_kernel_s_logits(tmp_path):
    """A Q4_K/Q6_K model (random blocks) on the AMX buffers: passes of 2-33 tokens through the
    fused kernels (default), the one-row kernel per row (GGML_AMX_VNNI_PER_ROW=1) and the tiles
    (GGML_AMX_VNNI_ROWS=1) give the same logits, the first two to the bit. Each setting is read
    once per process, hence the children."""
    tokens = byte_tokens()[:-len(SPECIAL)]
    tokens = [*tokens, "ab", *[f"<x{i}>" for i in range(-(len(tokens) + 1 + len(SPECIAL)) % 32)],
              *SPECIAL]
    dim, layers, ffn = 256, 2, 512
    path = tmp_path / "kquant.gguf"
    write_gguf(path, random_kquant_weights(len(tokens), dim, layers, ffn), tokens,
               merges=["a b"], shape=(dim, layers, 4, 4, ffn))
    runs = {}
    for name, extra in (("fused", {}), ("per_row", {"GGML_AMX_VNNI_PER_ROW": "1"}),
                        ("tiles", {"GGML_AMX_VNNI_ROWS": "1"})):
        env = {**os.environ, llama_amx.ENV: "on", **extra}
        out = tmp_path / f"{name}.npz"
        subprocess.run([sys.executable, "-c", CHILD, str(path), str(out), *map(str, PASSES)],
                       env=env, check=True, timeout=300)
        runs[name] = np.load(out)
    for n in map(str, PASSES):
        fused = runs["fused"][n]
        assert np.isfinite(fused).all() and fused.std() > 0.1, n
        assert np.array_equal(fused, runs["per_row"][n]), n
        np.testing.assert_allclose(fused, runs["tiles"][n], atol=1e-3 * np.abs(fused).max())
