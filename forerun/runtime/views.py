"""A runtime's many-sequence view, and what one token of it costs in KV memory.

Owns: `batched_view`, which wraps a one-sequence runtime into the BatchRuntime the batch step
drives (torch: a cache pool of its own; llama.cpp: a context of as many cells as the budget
holds; anything else: a fork per member), and `kv_token_bytes`, the KV bytes one token takes
in such a pool. Both the engine (its batched target and draft) and the drafter worker of
`--disaggregate` (its draft pool, in its own process) build their views here.
"""

from __future__ import annotations

from forerun.runtime.base import Runtime
from forerun.runtime.batch import BatchRuntime, BatchTorchRuntime
from forerun.runtime.forked import ForkedBatch
from forerun.runtime.torch_model import TorchRuntime

LLAMA_KV_ITEMSIZE = 2  # llama.cpp's batched pool keeps K and V in f16


def batched_view(runtime: Runtime, budget: int) -> BatchRuntime:
    """A runtime's many-sequence view, its KV cache sized by `budget` bytes."""
    if isinstance(runtime, TorchRuntime):
        return BatchTorchRuntime(runtime, budget)
    try:  # llama.cpp is optional: its runtime exists only where llama-cpp-python does
        from forerun.runtime.llama_batch import BatchLlamaRuntime
        from forerun.runtime.llama_cpp import LlamaCppRuntime
    except ImportError:
        LlamaCppRuntime = None
    if LlamaCppRuntime is not None and isinstance(runtime, LlamaCppRuntime):
        return BatchLlamaRuntime.with_budget(runtime, budget)
    return ForkedBatch(runtime)  # any other runtime: a fork per member, one pass each


def kv_token_bytes(runtime: Runtime) -> int:
    """KV-cache bytes one token takes in a runtime's batched pool: K and V of every layer, in
    the torch model's dtype (llama.cpp: f16)."""
    cfg = runtime.config
    itemsize = runtime.dtype.itemsize if isinstance(runtime, TorchRuntime) else LLAMA_KV_ITEMSIZE
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize
