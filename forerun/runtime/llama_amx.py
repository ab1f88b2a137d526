"""Whether llama.cpp may run a model's matmuls on this CPU's AMX tiles.

Owns: the decision behind `use_extra_bufts` on CPUs with AMX, and the probe that makes it.

llama.cpp repacks quantized weights into "extra" buffer types: AMX on CPUs with AMX, its
AVX2/AVX512 repack elsewhere. On AMX the matmuls of 2+ rows (prompts, verify passes) run on the
tiles, which flattens the verify curve (README, Runtimes). llama-cpp-python 0.3.36 as released
crashes there in two ways, both in how it configures the tiles: (1) built by GCC 12 it faults
at once (SIGSEGV, llama.cpp issue 20824): dead-store elimination drops the stores that fill the
tile configuration before `_tile_loadconfig`, which GCC does not see reading them; (2) it loads
the configuration once per thread, but PyTorch's oneDNN, in the same process and on the same
OpenMP threads, releases the tiles after each of its AMX kernels, so llama.cpp's next tile
instruction raises SIGILL. `make install` builds it with patches/llama-cpp-python-0.3.36-amx.patch,
which keeps the configuration in constant memory and loads it before every use.

A segfault cannot be caught in-process, so the first load of a model with AMX-capable tensors
on an AMX CPU runs a probe in a child process: the model loads with and without the extra
buffers; an 8-token batch runs through both, then a bfloat16 torch matmul (oneDNN's AMX path),
then the batch again on the AMX buffers. The AMX buffers are used only if the child exits
cleanly and the logits agree. The verdict is cached per (llama.cpp library, model file) in
FORERUN_HOME/llama_cpp_amx.json; FORERUN_LLAMA_AMX=on|off skips the probe.

Run as `python -m forerun.runtime.llama_amx MODEL.gguf` it is that child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENV = "FORERUN_LLAMA_AMX"  # on | off | auto (default: probe)
CACHE_FILE = "llama_cpp_amx.json"
# a batch past the rows that take AVX512-VNNI kernels (up to 32 in forerun's patch,
# GGML_AMX_VNNI_ROWS): the tile path, where the faults were
PROBE_TOKENS = 48
PROBE_TIMEOUT_S = 300
MIN_COSINE = 0.99  # AMX vs plain kernels: both quantize activations to 8 bits; garbage is ~0
# GGML types that llama.cpp 0.3.36 repacks for AMX (ggml-cpu/amx/common.h):
# F16, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS
AMX_TYPES = frozenset({1, 2, 3, 8, 12, 13, 14, 23})


def cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def use_extra_buffers(model: Path) -> bool:
    """Whether to load `model` with llama.cpp's extra buffer types (AMX / repack)."""
    if not cpu_has_amx():
        return True  # the AVX2/AVX512 repack buffers: no known fault
    setting = os.environ.get(ENV, "auto").lower()
    if setting in ("on", "1", "true"):
        return True
    if setting in ("off", "0", "false"):
        return False
    key, cache_path = _fingerprint(model), _cache_path()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return bool(cache[key]["ok"])
    if not _has_amx_tensors(model):  # read only on a miss: the GGUF directory takes ~0.4 s
        return True  # nothing would be placed in an AMX buffer
    cache[key] = probe(model)
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cache, indent=1))
    except OSError:
        pass  # an unwritable cache costs a probe next time, nothing else
    return bool(cache[key]["ok"])


def probe(model: Path) -> dict:
    """Run the child probe on `model`; {"ok": bool, "why": str}."""
    try:
        child = subprocess.run([sys.executable, "-m", __name__, str(model)], capture_output=True,
                               text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"probe timed out after {PROBE_TIMEOUT_S} s"}
    if child.returncode != 0:
        return {"ok": False, "why": f"probe exited with status {child.returncode}"}
    try:
        cosine = float(child.stdout.split()[-1])
    except (IndexError, ValueError):
        return {"ok": False, "why": f"probe printed no result: {child.stdout[-200:]!r}"}
    return {"ok": cosine >= MIN_COSINE, "why": f"logit cosine {cosine:.5f} (AMX vs plain)"}


def _has_amx_tensors(model: Path) -> bool:
    from forerun.models.gguf_file import GGUFFile

    try:
        return any(int(t.qtype) in AMX_TYPES for t in GGUFFile(model).tensors.values())
    except (OSError, ValueError):
        return False  # not a readable GGUF: llama.cpp will say so itself


def library_dir() -> Path:
    """The `lib/` folder of the llama-cpp-python in use: its libllama and ggml libraries."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def _fingerprint(model: Path) -> str:
    libs = sorted(library_dir().glob("libggml-cpu*"))
    parts = [f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in libs[:1]]
    st = model.stat()
    return "|".join([*parts, f"{model.resolve()}:{st.st_size}"])


def _cache_path() -> Path:
    from forerun.models.catalog import forerun_home

    return forerun_home() / CACHE_FILE


def _child(model: str) -> None:
    """Decode a batch on `model` without, then with the extra buffers; run a bfloat16 torch
    matmul; decode on the extra buffers again. Print the lowest cosine between the plain run's
    last-row logits and an extra-buffer run's. A broken AMX build dies here, not in the caller."""
    import numpy as np
    import torch
    from llama_cpp import llama_cpp as C

    C.llama_backend_init()
    rows = []
    for extra in (False, True):
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra
        m = C.llama_model_load_from_file(model.encode(), mparams)
        if not m:
            sys.exit(3)
        n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(m))
        cparams = C.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 64
        ctx = C.llama_init_from_model(m, cparams)
        ids = [(7 + 31 * i) % n_vocab for i in range(PROBE_TOKENS)]
        for _ in range(2 if extra else 1):
            C.llama_memory_clear(C.llama_get_memory(ctx), True)
            tokens = (C.llama_token * PROBE_TOKENS)(*ids)
            if C.llama_decode(ctx, C.llama_batch_get_one(tokens, PROBE_TOKENS)) != 0:
                sys.exit(4)
            rows.append(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1),
                                              shape=(n_vocab,)).astype(np.float64))
            x = torch.ones(64, 64, dtype=torch.bfloat16)
            (x @ x).sum().item()  # oneDNN: on AMX CPUs, tiles configured and released
        C.llama_free(ctx)
        C.llama_model_free(m)
    plain = rows[0]
    cosines = [float(plain @ r / (np.linalg.norm(plain) * np.linalg.norm(r) + 1e-30))
               for r in rows[1:]]
    print(f"{min(cosines):.6f}")


if __name__ == "__main__":
    _child(sys.argv[1])
