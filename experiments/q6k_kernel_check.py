"""The x86 q6_K kernel of the -q6k patch, checked and timed through ctypes on random blocks in
llama.cpp's block_q6_Kx8 layout (4-byte interleave, quants in the order the kernel reads them):
against ggml's generic kernel (relative error), each column count 1-8 against the one-row
kernel (to the bit), and the GB/s of one row streaming a 191 MB LM head from memory next to the
q4_K 8x8 kernel's.

    python experiments/q6k_kernel_check.py [PATH/libggml-cpu.so.0]   # default: the installed one
    python experiments/q6k_kernel_check.py --no-timing               # the checks only (tests/)
"""

import ctypes
import sys
import time

import numpy as np

from forerun.runtime.llama_amx import library_dir

args = [a for a in sys.argv[1:] if a != "--no-timing"]
lib = ctypes.CDLL(args[0] if args else str(library_dir() / "libggml-cpu.so.0"))
lib.ggml_cpu_init()  # ggml's fp16 table, which the generic kernel reads
rng = np.random.default_rng(0)
P, INT, Z = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
Q6X8 = [("d", "<f2", 8), ("scales", "i1", 128), ("ql", "u1", 1024), ("qh", "u1", 512)]
Q8K = [("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)]


def q6_blocks(rows: int, nb: int) -> np.ndarray:
    blk = np.zeros((rows // 8, nb), dtype=Q6X8)
    blk["d"] = rng.uniform(0.001, 0.01, blk["d"].shape).astype(np.float16)
    for name in ("scales", "ql", "qh"):
        blk[name] = rng.integers(0, 256, blk[name].shape).astype(blk[name].dtype)
    return blk


def x86_order(blk: np.ndarray) -> np.ndarray:
    """The x86 kernel's byte order of a block's quants (forerun_q6_K_8x4_order in the diff)."""
    out = blk.copy()
    ql, qh = blk["ql"].reshape(*blk.shape, 32, 32), blk["qh"].reshape(*blk.shape, 16, 32)
    runs = [run for h in range(2) for r in range(8)
            for run in (qh[..., 8 * h + r, :], ql[..., 16 * h + r, :], ql[..., 16 * h + r + 8, :])]
    quants = np.stack(runs, axis=-2).reshape(*blk.shape, 1536)
    out["ql"], out["qh"] = quants[..., :1024], quants[..., 1024:]
    return out


def q8_rows(cols: int, nb: int) -> np.ndarray:
    act = np.zeros((cols, nb), dtype=Q8K)
    act["d"] = rng.uniform(0.01, 0.1, act["d"].shape)
    act["qs"] = rng.integers(-128, 128, act["qs"].shape)
    act["bsums"] = act["qs"].astype(np.int32).reshape(cols, nb, 16, 16).sum(-1)
    return act


gemv, generic = lib.ggml_gemv_q6_K_8x4_q8_K, lib.ggml_gemv_q6_K_8x4_q8_K_generic
cols_kernel, q4 = lib.ggml_gemv_q6_K_8x4_q8_K_cols, lib.ggml_gemv_q4_K_8x8_q8_K
for fn in (gemv, generic, q4):
    fn.argtypes = [INT, P, Z, P, P, INT, INT]
cols_kernel.argtypes = [INT, P, Z, P, P, Z, INT, INT]

nb, rows, ncol = 6, 32, 8  # 8: the most a call takes (4 with VNNI)
blk, act = q6_blocks(rows, nb), q8_rows(ncol, nb)
ours = x86_order(blk)  # the same weights in the kernel's order; ggml's generic reads blk
ref, one = np.zeros((ncol, rows), np.float32), np.zeros((ncol, rows), np.float32)
for c in range(ncol):
    a = np.ascontiguousarray(act[c])
    generic(256 * nb, ref[c].ctypes.data, 0, blk.ctypes.data, a.ctypes.data, 1, rows)
    gemv(256 * nb, one[c].ctypes.data, 0, ours.ctypes.data, a.ctypes.data, 1, rows)
print("vs generic: max relative difference", np.abs(ref - one).max() / np.abs(ref).max())
for k in range(1, ncol + 1):
    out = np.zeros_like(ref)
    cols_kernel(256 * nb, out.ctypes.data, rows, ours.ctypes.data, act.ctypes.data,
                act.itemsize * nb, k, rows)
    assert np.array_equal(out[:k], one[:k]), k
print(f"1-{ncol} columns equal the one-row kernel to the bit")

# the extremes of the integer sums (the AVX2 build adds two steps' products in 16 bits):
# every weight 63, scales +-127/-128, activations all -128, all 127, alternating, random
blk["ql"], blk["qh"] = 0xFF, 0xFF
blk["scales"] = np.where(rng.random(blk["scales"].shape) < 0.5, 127, -128)
act["qs"][0], act["qs"][1] = -128, 127
act["qs"][2] = np.where(np.arange(256) % 2 == 0, -128, 127)
act["bsums"] = act["qs"].astype(np.int32).reshape(ncol, nb, 16, 16).sum(-1)
ours = x86_order(blk)
out = np.zeros_like(ref)
for c in range(ncol):
    a = np.ascontiguousarray(act[c])
    generic(256 * nb, ref[c].ctypes.data, 0, blk.ctypes.data, a.ctypes.data, 1, rows)
cols_kernel(256 * nb, out.ctypes.data, rows, ours.ctypes.data, act.ctypes.data,
            act.itemsize * nb, ncol, rows)
worst = float((np.abs(ref - out) / np.abs(ref).max(axis=1, keepdims=True)).max())
print(f"extreme values vs generic: max relative difference {worst:.2e}")
assert worst < 1e-5, worst


if "--no-timing" in sys.argv:
    sys.exit(0)


def best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


rows = 151936  # the default target's LM head, one thread
big, a0, out = q6_blocks(rows, nb), q8_rows(1, nb), np.zeros(rows, np.float32)
ms = best_ms(lambda: gemv(256 * nb, out.ctypes.data, 0, big.ctypes.data, a0.ctypes.data, 1, rows))
mb = big.nbytes / 1e6
print(f"q6_K 8x4, one row, {mb:.0f} MB: {ms:.1f} ms, {mb / ms:.1f} GB/s")
q4_bytes = rows // 8 * nb * 1152  # block_q4_Kx8: 1152 bytes, as many rows
raw4 = rng.integers(0, 256, q4_bytes, dtype=np.uint8)
ms = best_ms(lambda: q4(256 * nb, out.ctypes.data, 0, raw4.ctypes.data, a0.ctypes.data, 1, rows))
print(f"q4_K 8x8, one row, {q4_bytes / 1e6:.0f} MB: {ms:.1f} ms, {q4_bytes / 1e6 / ms:.1f} GB/s")
