"""The AMX decision for llama.cpp: overrides, models with nothing to repack, the cache, and the
child probe on a real quantized model (it must run cleanly and agree with the plain kernels on
every machine with our build: on AMX CPUs the tiles, elsewhere the AVX repack). The patched
kernels' own tests are in test_llama_kernels.py."""

import json

import pytest
from tiny_files import byte_tokens, random_hf_weights, write_gguf

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
