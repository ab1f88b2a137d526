"""The multi-row kernels our llama.cpp patches add (patches/): each gives, for every row of a
pass, the logits of llama.cpp's one-row kernel to the bit, so a verify pass costs less without
changing a number. Checked on a random Q4_K/Q6_K model (the K-quants of a Q4_K_M file), each
setting in a child process (the kernels read their switches once per process):

- AVX2 (any x86 CPU without AMX): q4_K passes of 2+ rows (instead of ggml's gemm on groups of
  4 and gemv on the rest) and q6_K matmuls of 2+ rows (the LM head, instead of the one-row loop
  and the tiled path) unpack each weight block once; GGML_Q4_K_COLS=0 / GGML_Q6_K_COLS=0 restore
  ggml's paths; on CPUs with AVX512-VNNI the q4_K kernel multiplies with VNNI (-vnni patch:
  the same integer sums, so the same bits). Since the -q6k patch, q6_K weights are repacked
  into 8-row interleaved blocks and every q6_K matmul, one row or many, takes one kernel
  (GGML_Q6_K_REPACK=0 keeps ggml's layout and the kernels above). Since the -weights-tiled
  patch, a pass of several row groups runs every group over one tile of the weights before the
  next (GGML_FORERUN_TILE=0: each group over all of them, as before), and with AVX-512
  groups of 8+ rows take a zmm q4_K kernel (-zmm; GGML_Q4_K_ZMM=0: the ymm one). Without
  AVX-512 VNNI, one-row q4_K passes take the multi-row kernel too, which prefetches the weights
  as the q6_K one does (-x86-stream-prefetch; GGML_Q4_K_COLS_MIN=2, GGML_Q6_K_PREFETCH=0). Since
  every row is then the one-row kernel's (and, with the patch, a one-row attention past 512
  cached tokens is no longer split by KV chunks where every thread has heads of its own), a
  verify pass of up to 48 tokens gives plain decoding's logits, to the bit. The activations'
  q8_K quantizer (-q8k-avx512, -x86-q8k-avx2) gives ggml's reference bytes. Without VNNI the
  q4_K and q6_K kernels sum the same integers in another order (-x86-avx2-rows), so the same
  bits again, and q6_K passes go in groups of up to 8 rows instead of 4.
- AMX: the fused VNNI rows (GGML_AMX_VNNI_PER_ROW=1 restores the per-row loop,
  GGML_AMX_VNNI_ROWS=1 the tiles).
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tiny_files import SPECIAL, byte_tokens, random_kquant_weights, write_gguf

from forerun.runtime import llama_amx

pytest.importorskip("llama_cpp")

CHILD = """
import sys, numpy as np, torch
from forerun.models.load import open_model
rt = open_model(sys.argv[1]).load(runtime="llama.cpp", context=1024)
# past 512 cached tokens, where ggml splits a one-row attention over the threads by KV chunks
rt.forward(torch.arange(600) % 200 + 3, last_only=True)
out = {}
for n in map(int, sys.argv[3:]):
    rt.truncate(600)
    out[str(n)] = rt.forward(torch.arange(40, 40 + n)).logits.numpy()
rt.truncate(600)  # the same tokens one at a time: plain decoding's passes
out["one_by_one"] = np.concatenate([rt.forward(torch.tensor([40 + i])).logits.numpy()
                                    for i in range(max(map(int, sys.argv[3:])))])
np.savez(sys.argv[2], **out)
"""


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    tokens = byte_tokens()[:-len(SPECIAL)]
    tokens = [*tokens, "ab", *[f"<x{i}>" for i in range(-(len(tokens) + 1 + len(SPECIAL)) % 32)],
              *SPECIAL]
    dim, layers, ffn = 256, 2, 512
    path = tmp_path_factory.mktemp("kquant") / "kquant.gguf"
    write_gguf(path, random_kquant_weights(len(tokens), dim, layers, ffn), tokens,
               merges=["a b"], shape=(dim, layers, 4, 4, ffn), context=1024)
    return path


def run_child(path, out, passes, **env):
    env = {**os.environ, llama_amx.ENV: "on", **env}
    subprocess.run([sys.executable, "-c", CHILD, str(path), str(out), *map(str, passes)],
                   env=env, check=True, timeout=300)
    return np.load(out)


# q4_K: one group, two and three near-equal groups; 64 rows: a prompt's size, where ggml's
# tiled attention (not the kernels) makes the rows differ from one-token passes in the last bits
AVX2_PASSES = (2, 3, 4, 5, 9, 16, 17, 33, 64)


@pytest.mark.skipif(llama_amx.cpu_has_amx(), reason="AMX CPUs take the AMX kernels instead")
def test_avx2_multi_row_kernels_give_the_one_row_kernels_logits(kquant_gguf, tmp_path):
    fused = run_child(kquant_gguf, tmp_path / "fused.npz", AVX2_PASSES)
    loops = run_child(kquant_gguf, tmp_path / "loops.npz", AVX2_PASSES,
                      GGML_Q4_K_COLS="0", GGML_Q6_K_COLS="0", GGML_Q6_K_REPACK="0")
    for n in map(str, AVX2_PASSES):
        assert np.isfinite(fused[n]).all() and fused[n].std() > 0.1, n
        # ggml's gemm sums in another order than its gemv: its passes of 4+ rows differ a little
        np.testing.assert_allclose(fused[n], loops[n], atol=1e-3 * np.abs(fused[n]).max())
        # the fused kernels' rows are the one-row kernels': a pass equals one token at a time
        if int(n) <= 48:
            assert np.array_equal(fused[n], fused["one_by_one"][:int(n)]), n
    assert np.array_equal(loops["3"], loops["one_by_one"][:3])  # gemv rows only: exact too
    # -weights-tiled: passes of several row groups run group by group over tiles of the weights
    # (here 8 weight rows, the smallest tile, so this small model's matrices split too): the same
    # kernels on the same operands, so the same bits as one call per group over every row
    tiled = run_child(kquant_gguf, tmp_path / "tiled.npz", AVX2_PASSES, GGML_FORERUN_TILE="1")
    for n in map(str, AVX2_PASSES):
        assert np.array_equal(tiled[n], fused[n]), n
    untiled = run_child(kquant_gguf, tmp_path / "untiled.npz", AVX2_PASSES, GGML_FORERUN_TILE="0")
    for n in map(str, AVX2_PASSES):
        assert np.array_equal(untiled[n], fused[n]), n
    # -zmm (AVX-512 builds): the groups of 8+ rows of the 9-64-row passes above took the zmm
    # kernel; the ymm one gives the same bits
    ymm = run_child(kquant_gguf, tmp_path / "ymm.npz", AVX2_PASSES, GGML_Q4_K_ZMM="0")
    for n in map(str, AVX2_PASSES):
        assert np.array_equal(ymm[n], fused[n]), n
    # -x86-stream-prefetch (builds without AVX-512 VNNI): one-row q4_K passes take the multi-row
    # kernel, and it and the q6_K kernel prefetch the weights; ggml's gemv and no prefetch: the
    # same bits
    gemv = run_child(kquant_gguf, tmp_path / "gemv.npz", AVX2_PASSES, GGML_Q4_K_COLS_MIN="2",
                     GGML_FORERUN_PREFETCH_ROWS="8", GGML_Q6_K_PREFETCH="0")
    for n in [*map(str, AVX2_PASSES), "one_by_one"]:
        assert np.array_equal(gemv[n], fused[n]), n


AMX_PASSES = (2, 3, 5, 9, 12, 13, 25, 33)  # tokens a pass: one fused group, two, three; tiles


@pytest.mark.skipif(not llama_amx.cpu_has_amx(), reason="the AMX kernels run on AMX CPUs only")
def test_fused_vnni_rows_give_the_one_row_kernel_s_logits(kquant_gguf, tmp_path):
    """Passes of 2-33 tokens through the fused kernels (default), the one-row kernel per row and
    the tiles give the same logits, the first two to the bit."""
    runs = {name: run_child(kquant_gguf, tmp_path / f"{name}.npz", AMX_PASSES, **extra)
            for name, extra in (("fused", {}), ("per_row", {"GGML_AMX_VNNI_PER_ROW": "1"}),
                                ("tiles", {"GGML_AMX_VNNI_ROWS": "1"}))}
    for n in map(str, AMX_PASSES):
        fused = runs["fused"][n]
        assert np.isfinite(fused).all() and fused.std() > 0.1, n
        assert np.array_equal(fused, runs["per_row"][n]), n
        np.testing.assert_allclose(fused, runs["tiles"][n], atol=1e-3 * np.abs(fused).max())


def test_q6k_kernel_matches_ggml_and_is_exact_across_row_counts():
    """-q6k: the interleaved q6_K kernel against ggml's generic one on random blocks and on the
    extremes of its integer sums (relative error < 1e-5; -x86-q6k-pairs adds two steps'
    products in 16 bits without VNNI) and 1-8 activation rows against one (to the bit);
    experiments/q6k_kernel_check.py through ctypes, where the build has the kernel (x86, AVX2)."""
    import ctypes
    from pathlib import Path

    from forerun.runtime.llama_amx import library_dir

    lib = library_dir() / "libggml-cpu.so.0"
    if not lib.exists() or not hasattr(ctypes.CDLL(str(lib)), "ggml_gemv_q6_K_8x4_q8_K_cols"):
        pytest.skip("this build has no -q6k kernel (not x86 with AVX2)")
    script = Path(__file__).parents[1] / "experiments" / "q6k_kernel_check.py"
    out = subprocess.run([sys.executable, str(script), str(lib), "--no-timing"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    error = float(out.split("max relative difference")[1].split()[0])
    assert error < 1e-5 and "equal the one-row kernel to the bit" in out, out
    assert "extreme values vs generic" in out, out  # the integer sums' limits (asserted there)


def test_q8k_activation_quantizer_equals_ggml_reference():
    """-q8k-avx512 and -x86-q8k-avx2: llama.cpp quantizes every activation row of a K-quant
    model's matmuls to q8_K; the AVX-512 and AVX2 quantizers give quantize_row_q8_K_ref's bytes
    (scale, quants, sums of 16) for random rows, rows with a magnitude tie of opposite signs,
    exact halves after scaling, an all-zero block, negative zeros and infinities (a build
    without AVX2 calls the reference itself)."""
    import ctypes

    from forerun.runtime.llama_amx import library_dir

    base = ctypes.CDLL(str(library_dir() / "libggml-base.so.0"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(library_dir() / "libggml-cpu.so.0"))
    block = 4 + 256 + 2 * 16  # d, qs, bsums

    def quantize(fn, x):
        out = np.zeros(len(x) // 256 * block, np.uint8)
        fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
           ctypes.c_int64(len(x)))
        return out

    rng = np.random.default_rng(0)
    for trial in range(600):
        n = 256 * int(rng.integers(1, 12))
        x = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0, 1e4])
        if trial % 5 == 1:  # the largest magnitude twice, opposite signs: the first one counts
            i, j = rng.integers(n, size=2)
            x[i], x[j] = 5 * np.abs(x).max(), -5 * np.abs(x).max()
        if trial % 5 == 2:  # values that scale to exact halves
            x = rng.integers(-254, 255, n) / 254.0
            x[0] = 1.0
        if trial % 5 == 3:
            x[:256] = 0
            x[:256:3] = -0.0
        if trial % 25 == 4:  # an infinity in the last block (its scale is 0: the ref's path)
            x[-int(rng.integers(1, 256))] = rng.choice([np.inf, -np.inf])
        x = np.ascontiguousarray(x, np.float32)
        assert np.array_equal(quantize(base.quantize_row_q8_K_ref, x),
                              quantize(cpu.quantize_row_q8_K, x)), trial


def test_makefile_applies_every_patch_in_its_list():
    """`make install` applies the patches in the Makefile's order (LLAMA_PATCH_NAMES: each was
    made against the ones before it); a patch file left out of that list would never apply."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    text = root.joinpath("Makefile").read_text().replace("\\\n", " ")
    names = next(line for line in text.splitlines() if line.startswith("LLAMA_PATCH_NAMES"))
    listed = names.split(":=")[1].split()
    on_disk = sorted(re.sub(r"^llama-cpp-python-[\d.]+-", "", p.stem)
                     for p in root.joinpath("patches").glob("*.patch"))
    assert sorted(listed) == on_disk and len(set(listed)) == len(listed), (listed, on_disk)
