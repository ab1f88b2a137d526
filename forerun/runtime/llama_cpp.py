"""A Runtime on llama.cpp (through llama-cpp-python's C API): the GGUF file runs as it is, on
llama.cpp's own quantized CPU kernels.

Owns: one llama.cpp model and context holding a single sequence (sequence id 0), a token batch
allocated once and refilled in place, and copying out the logit rows that were asked for.
Never samples, never tokenizes: forerun's tokenizer makes the token ids.

Invariants: cache position i holds the i-th token appended, as in TorchRuntime; `truncate(n)`
removes positions >= n from llama.cpp's KV cache (`llama_memory_seq_rm`), so the next forward
writes them afresh. A forward longer than the batch size is decoded in batch-sized chunks.

Differences from TorchRuntime, all explicit errors rather than silent fallbacks:
- weights stay quantized as in the file, so `dtype` does not apply (activations are quantized to
  8 bits inside llama.cpp's matmuls); logits come back float32;
- hidden states: only the final normed layer (-1), which llama.cpp exposes as its embeddings;
- tree verification (tree_mask, non-chain positions) would need one llama.cpp sequence per
  branch; not implemented.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from pathlib import Path

import numpy as np
import torch
from llama_cpp import llama_cpp as C

from forerun.runtime.base import ForwardOutput, ModelConfig

DEFAULT_BATCH = 512  # tokens per llama_decode call (n_batch = n_ubatch); longer input is chunked
SEQ = 0  # the one sequence this runtime holds
FINAL_NORMED = -1  # hidden_layers key of the final normed hidden state (llama.cpp's embeddings)
DECODE_OK, DECODE_NO_SLOT = 0, 1  # llama_decode return codes (llama.h)
TREE_UNSUPPORTED = ("tree verification on llama.cpp needs multi-sequence batches; "
                    "not implemented yet")

# ggml_log_level in the llama.cpp this is pinned to: DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
# (llama-cpp-python's own logger maps an older numbering and lets warnings through)
LOG_ERROR = 4
MAX_ERRORS = 4  # recent llama.cpp error lines kept for our exception messages
_errors: list[str] = []
_backend_ready = False


@C.llama_log_callback
def _log(level: int, text: bytes, user_data) -> None:
    """llama.cpp logs every load and decode to stderr; keep only its error lines, for ours."""
    if level == LOG_ERROR:
        _errors.append(text.decode(errors="replace").strip())
        del _errors[:-MAX_ERRORS]


def _llama_errors() -> str:
    return f" (llama.cpp: {'; '.join(_errors)})" if _errors else ""


def _init_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        C.llama_log_set(_log, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on: llama.cpp's matmuls gain nothing
    from a core's second hardware thread and lose from oversubscription."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return len(cores)


def _free(ctx, model) -> None:
    C.llama_free(ctx)
    C.llama_model_free(model)


class LlamaCppRuntime:
    """Runtime over a llama.cpp context: one sequence, a KV cache of `capacity` positions."""

    def __init__(self, path: Path, config: ModelConfig, capacity: int, *,
                 n_threads: int | None = None, batch: int = DEFAULT_BATCH, gpu: bool = False):
        """`gpu`: offload every layer (needs a llama-cpp-python built with a GPU backend)."""
        _init_backend()
        if gpu and not C.llama_supports_gpu_offload():
            raise RuntimeError("this llama-cpp-python build runs on the CPU only; rebuild it "
                               "with a GPU backend (CMAKE_ARGS=-DGGML_CUDA=on) or use --device cpu")
        self.config = config
        self._capacity = min(capacity, config.context_length)
        self.batch_size = batch
        threads = n_threads or physical_cores()

        _errors.clear()
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = -1 if gpu else 0
        self._model = C.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}{_llama_errors()}")
        cparams = C.llama_context_default_params()
        cparams.n_ctx = self._capacity
        cparams.n_batch = cparams.n_ubatch = batch
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        self._ctx = C.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            C.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not create a context of {self._capacity} "
                               f"tokens{_llama_errors()}")
        weakref.finalize(self, _free, self._ctx, self._model)
        self._memory = C.llama_get_memory(self._ctx)
        self.vocab_size = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self._model))
        if self.vocab_size != config.vocab_size:
            raise RuntimeError(f"llama.cpp reads {self.vocab_size} tokens from {path}, the GGUF "
                               f"metadata says {config.vocab_size}")
        self.dim = C.llama_model_n_embd(self._model)
        self._length = 0
        self._alloc_batch(batch)

    def _alloc_batch(self, n: int) -> None:
        """A llama_batch whose arrays are numpy buffers we own: a forward copies token ids,
        positions and output flags in with three slice assignments, no per-token Python."""
        self._tokens = np.zeros(n, np.int32)
        self._positions = np.zeros(n, np.int32)
        self._outputs = np.zeros(n, np.int8)
        self._n_seq = np.ones(n, np.int32)
        self._seq_id = (C.llama_seq_id * 1)(SEQ)
        seq_ptr = ctypes.cast(self._seq_id, ctypes.POINTER(C.llama_seq_id))
        self._seq_ids = (ctypes.POINTER(C.llama_seq_id) * n)(*([seq_ptr] * n))

        def ptr(a, ctype):
            return a.ctypes.data_as(ctypes.POINTER(ctype))

        self._batch = C.llama_batch(
            n_tokens=0, token=ptr(self._tokens, C.llama_token), embd=None,
            pos=ptr(self._positions, C.llama_pos), n_seq_id=ptr(self._n_seq, ctypes.c_int32),
            seq_id=self._seq_ids, logits=ptr(self._outputs, ctypes.c_int8))

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        if length < self._length and not C.llama_memory_seq_rm(self._memory, SEQ, length, -1):
            raise RuntimeError(f"llama.cpp could not remove cache positions >= {length}")
        self._length = length

    def forward(self, tokens, *, positions=None, tree_mask=None, last_only=False,
                hidden_layers=()) -> ForwardOutput:
        start, T = self._length, tokens.shape[0]
        if start + T > self._capacity:
            raise ValueError(f"context full: {start} + {T} tokens > capacity {self._capacity}")
        chain = positions is None or torch.equal(
            positions.cpu(), torch.arange(start, start + T, dtype=positions.dtype))
        if tree_mask is not None or not chain:
            raise NotImplementedError(TREE_UNSUPPORTED)
        unavailable = sorted(set(hidden_layers) - {FINAL_NORMED})
        if unavailable:
            raise NotImplementedError(
                f"llama.cpp exposes only the final normed hidden state (layer -1), "
                f"not layers {unavailable}")
        want_hidden = FINAL_NORMED in hidden_layers
        ids = np.asarray(tokens.cpu(), dtype=np.int32)  # [T]
        if T and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        logits, hidden = [], []
        if want_hidden:
            C.llama_set_embeddings(self._ctx, True)
        try:
            for begin in range(0, T, self.batch_size):
                end = min(T, begin + self.batch_size)
                keep = (1 if end == T else 0) if last_only else end - begin
                # llama.cpp returns embeddings only with every token of the batch an output
                rows = end - begin if want_hidden else keep
                self._decode(ids[begin:end], start + begin, rows)
                if keep:
                    logits.append(self._read(C.llama_get_logits, rows, self.vocab_size, keep))
                    if want_hidden:
                        hidden.append(self._read(C.llama_get_embeddings, rows, self.dim, keep))
        except BaseException:
            C.llama_memory_seq_rm(self._memory, SEQ, start, -1)  # forget the partial chunks
            raise
        finally:
            if want_hidden:
                C.llama_set_embeddings(self._ctx, False)
        self._length = start + T
        if T == 0:
            logits, hidden = [torch.empty(0, self.vocab_size)], [torch.empty(0, self.dim)]
        out = ForwardOutput(torch.cat(logits))  # [T, V] ([1, V] if last_only)
        if want_hidden:
            out.hidden[FINAL_NORMED] = torch.cat(hidden)  # [T, D] ([1, D] if last_only)
        return out

    def _decode(self, ids: np.ndarray, start: int, rows: int) -> None:
        """One llama_decode over ids at positions start.., with outputs for the last `rows`."""
        n = ids.shape[0]
        self._tokens[:n] = ids
        self._positions[:n] = np.arange(start, start + n, dtype=np.int32)
        self._outputs[:n - rows] = 0
        self._outputs[n - rows:n] = 1
        self._batch.n_tokens = n
        _errors.clear()
        code = C.llama_decode(self._ctx, self._batch)
        if code == DECODE_NO_SLOT:
            raise ValueError(f"llama.cpp found no KV cache room for {n} tokens at {start}")
        if code != DECODE_OK:
            raise RuntimeError(f"llama_decode failed with code {code}{_llama_errors()}")

    def _read(self, getter, rows: int, width: int, keep: int) -> torch.Tensor:
        """Copy the last `keep` of the last decode's `rows` output rows out of llama.cpp's buffer
        ([rows, width] float32, overwritten by the next decode): the only copy a forward makes."""
        view = np.ctypeslib.as_array(getter(self._ctx), shape=(rows, width))
        return torch.from_numpy(view[rows - keep:].copy())  # [keep, width]
