"""A Runtime on llama.cpp (through llama-cpp-python's C API): the GGUF file runs as it is, on
llama.cpp's own quantized CPU kernels.

Owns: one llama.cpp model and context holding one committed sequence (sequence id 0), token
batches allocated once and refilled in place, and copying out the logit rows that were asked for.
`fork()` opens another context on the same model: weights are loaded once, freed with the last
runtime that uses them.
Never samples, never tokenizes: forerun's tokenizer makes the token ids. Weights go in
llama.cpp's repacked ("extra") buffers, AMX tiles included where `forerun.runtime.llama_amx`
finds this build's AMX path sound.

Invariants: cache position i holds the i-th token appended, as in TorchRuntime; `truncate(n)`
removes positions >= n from llama.cpp's KV cache (`llama_memory_seq_rm`), so the next forward
writes them afresh. A forward longer than the batch size is decoded in batch-sized chunks.

Tree verification: llama.cpp has no attention-mask input, but its KV cache cells carry sets of
sequence ids and a token attends to the cells of its own sequences at positions <= its own. So a
tree pass (`tree_mask`, positions start + depth) gives each leaf a sequence, its root-to-leaf
path: leaf 0 is sequence 0 itself, leaf j > 0 is sequence j, which first gets the committed cache
(`llama_memory_seq_cp`, in a unified KV cache only a seq id added to each cell), and each token is
decoded once, in every sequence whose leaf descends from it. Each sequence then sees exactly its
path, at contiguous positions, as llama.cpp requires. `keep(start, rows)` moves the accepted path
into sequence 0 and drops the other sequences (`llama_memory_seq_keep`), freeing the rest of the
tree; until `keep` or `truncate` resolves a tree pass, a further forward is refused. Chains (and
a tree of one leaf) take the single-sequence batch, exactly as before. The context is opened with
`kv_unified` (a per-sequence split cache could not share the prefix) and `n_seq_max` =
MAX_TREE_LEAVES, the most leaves a tree may have.

Differences from TorchRuntime, all explicit errors rather than silent fallbacks:
- weights stay quantized as in the file, so `dtype` does not apply (activations are quantized to
  8 bits inside llama.cpp's matmuls); logits come back float32;
- hidden states: only the final normed layer (-1), which llama.cpp exposes as its embeddings,
  and only of output rows, whose logits it then computes too (an LM-head row each, ~3 ms for
  the default target here). forerun's llama.cpp patch (patches/*-hidden.patch) adds every
  row's state without logits to the dense qwen2 and llama graphs (the last layer's FFN run
  again over the rows wanted): a `last_only` forward that wants hidden states (a head's
  prefill) takes it, and its logits are plain's to the bit (with `hidden_from`, batch chunks
  wholly before that row compute no states, and in its own chunk the FFN skips the rows
  before it: ~32 rows of one layer for an EAGLE window, not the whole chunk); elsewhere
  `hidden_rows_cost_logits` tells heads to skip the prompt's;
- a tree pass puts each row at start + its depth (positions are checked, not free); it keeps
  one branch at a time (`keep` of a root-to-node path; `truncate` into a tree pass only where its
  first rows form one); and has at most MAX_TREE_LEAVES leaves (ValueError above);
- numerics: llama.cpp as released computes a pass of several tokens with other kernels than a
  one-token pass (activations are quantized per batch), so on quantized weights the cached keys
  and values, and every later logit, depend on the shapes of the passes that filled the cache
  (up to ~0.5 logit on the default target, Q4_K_M). forerun's `-avx2` patch (and on AMX CPUs
  the `-amx` patch's rows kernels) give passes of up to 48 tokens the one-token kernels'
  results to the bit, and `keep` rewrites the cache in position order after a tree step
  (`_compact`), so there greedy speculation equals plain greedy decoding exactly, trees
  included; elsewhere it equals it except at near-ties of that size. The torch runtime is
  exact in float32/float64 (the tests); bfloat16 matmuls round differently by batch shape.
"""

from __future__ import annotations

import copy
import ctypes
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from llama_cpp import llama_cpp as C

from forerun.runtime.base import Capabilities, ForwardOutput, ModelConfig
from forerun.runtime.llama_amx import library_dir, use_extra_buffers

# rows per llama_decode call (n_batch = n_ubatch); longer input (a prompt) is chunked. Under
# forerun's patches every row of a call of at most EXACT_ROWS rows gets the one-token kernels'
# result, and under GGML_FA_TILE_Q (64) rows the flash attention is per row, so a prompt's KV,
# and every later logit, is the same to the bit whether it is fed whole, a token a call or in a
# batch of many sequences (`forerun.runtime.llama_batch`). 512-row calls prefilled ~5-10% faster
# here (a 709-token prompt of the 1.5B target: 6.7-7.3 s against 7.6 s) but moved a long
# prompt's last logits by up to 0.65, so solo and batched decoding parted on long prompts.
EXACT_ROWS = 48
DEFAULT_BATCH = EXACT_ROWS
SEQ = 0  # the committed sequence; a tree pass's leaf j is sequence SEQ + j
# leaves (sequences) a tree pass may have: the context's n_seq_max. Verify trees are far smaller
# (tens of nodes); a larger bound costs only a [batch, MAX_TREE_LEAVES] int32 table per context.
MAX_TREE_LEAVES = 64
FINAL_NORMED = -1  # hidden_layers key of the final normed hidden state (llama.cpp's embeddings)
DECODE_OK, DECODE_NO_SLOT = 0, 1  # llama_decode return codes (llama.h)
TREE_MASK_HELP = ("tree_mask must be a token tree's ancestor mask: row 0 the root, each row "
                  "attending to itself and exactly its ancestors (forerun.tree.TokenTree.mask)")

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


def init_backend() -> None:
    """llama.cpp's backend, once per process, its log filtered to error lines (see _log)."""
    global _backend_ready
    if not _backend_ready:
        C.llama_log_set(_log, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _library_stamp(lib_dir: Path | None = None) -> list:
    """Name, size and mtime of each shared library of the llama-cpp-python in use (its
    `lib/` folder): a rebuild of the same version (another patch, another CPU's build) is
    another build, whose forward times are its own."""
    lib_dir = library_dir() if lib_dir is None else lib_dir
    try:
        files = sorted(p for p in lib_dir.iterdir() if p.is_file() and not p.is_symlink())
    except OSError:
        return []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


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


@dataclass
class _TreePass:
    """A tree pass appended at slot `start`: leaf j's root-to-leaf path is sequence SEQ + j."""

    start: int
    depth: np.ndarray  # [T] int32, the root 0
    member: np.ndarray  # [T, L] bool: row r lies on leaf j's path
    n_seq: np.ndarray  # [T] int32: sequences of each row
    seq_ids: np.ndarray  # [T, L] int32: those sequences' ids first, in order

    @staticmethod
    def of(start: int, tree_mask: torch.Tensor) -> _TreePass:
        """Checks that tree_mask [T, T] is an ancestor mask (row 0 the root) and reads it."""
        m = np.asarray(tree_mask.cpu(), dtype=bool)  # [T, T]
        T = m.shape[0]
        eye = np.eye(T, dtype=bool)
        above = m & ~eye  # [T, T]: strict ancestors
        # a row's parent is its deepest (last) ancestor; the root has none
        parent = np.where(above.any(1), T - 1 - np.argmax(above[:, ::-1], axis=1), 0)
        if not (m.diagonal().all() and m[:, 0].all()
                and not np.triu(above).any() and (m[1:] == (m[parent[1:]] | eye[1:])).all()):
            raise ValueError(TREE_MASK_HELP)
        member = m[~above.any(0)].T  # [T, L]: leaves are nobody's ancestor
        n_seq = member.sum(1, dtype=np.int32)
        seq_ids = SEQ + np.argsort(~member, axis=1, kind="stable").astype(np.int32)
        return _TreePass(start, m.sum(1, dtype=np.int32) - 1, member, n_seq, seq_ids)

    @property
    def leaves(self) -> int:
        return self.member.shape[1]

    def path_sequence(self, rows: list[int]) -> int | None:
        """A sequence holding `rows` as its first len(rows) tokens, or None if they are no
        root-to-node path."""
        n, T = len(rows), len(self.depth)
        if not all(0 <= r < T for r in rows) or (self.depth[rows] != np.arange(n)).any():
            return None
        on = self.member[rows].all(0)  # [L]
        return SEQ + int(on.argmax()) if on.any() else None


class _Weights:
    """A loaded llama.cpp model, freed when the last runtime (fork) using it is gone."""

    def __init__(self, path: Path, gpu: bool):
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = -1 if gpu else 0
        # repacked weights (AMX tiles on CPUs with AMX), unless this build's AMX path is broken
        mparams.use_extra_bufts = use_extra_buffers(path)
        self.model = C.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}{_llama_errors()}")
        weakref.finalize(self, C.llama_model_free, self.model)


def _hidden_all_rows(model) -> tuple | None:
    """The patch's (set, get, from) functions for every row's final normed hidden state, where
    this build has them and the model's graph fills it (dense qwen2 and llama); else None.
    `from` (None in builds before it) limits the next passes' rows to those from a batch row
    on: the last layer's FFN then skips the rows before it."""
    try:
        lib = C._lib
        supported = lib.forerun_hidden_all_rows_supported
        on, get = lib.forerun_hidden_all_rows, lib.forerun_get_hidden_all_rows
    except AttributeError:  # llama-cpp-python built without forerun's patch
        return None
    supported.argtypes, supported.restype = [C.llama_model_p_ctypes], ctypes.c_bool
    if not supported(model):
        return None
    on.argtypes, on.restype = [C.llama_context_p_ctypes, ctypes.c_bool], None
    get.argtypes, get.restype = [C.llama_context_p_ctypes], ctypes.POINTER(ctypes.c_float)
    rows_from = getattr(lib, "forerun_hidden_rows_from", None)
    if rows_from is not None:
        rows_from.argtypes, rows_from.restype = [C.llama_context_p_ctypes, ctypes.c_int32], None
    return on, get, rows_from


def _joined(chunks: list[torch.Tensor], width: int) -> torch.Tensor:
    """The chunks' rows in one [rows, width] tensor: a single chunk (every decode step) as
    read, not copied again by a cat; none: no rows."""
    if not chunks:
        return torch.empty(0, width)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class LlamaCppRuntime:
    """Runtime over a llama.cpp context: one sequence, a KV cache of `capacity` positions."""

    # stock llama.cpp returns hidden states only of output rows, whose logits it computes too;
    # an instance with the patch's all-rows states (`_all_rows`) clears it
    hidden_rows_cost_logits = True

    def __init__(self, path: Path, config: ModelConfig, capacity: int, *,
                 n_threads: int | None = None, batch: int = DEFAULT_BATCH, gpu: bool = False):
        """`gpu`: offload every layer (needs a llama-cpp-python built with a GPU backend)."""
        init_backend()
        if gpu and not C.llama_supports_gpu_offload():
            raise RuntimeError("this llama-cpp-python build runs on the CPU only; rebuild it "
                               "with a GPU backend (CMAKE_ARGS=-DGGML_CUDA=on) or use --device cpu")
        self.config = config
        self._capacity = min(capacity, config.context_length)
        self.batch_size = batch
        self._threads = n_threads or physical_cores()
        self._path, self._gpu = Path(path), gpu
        _errors.clear()
        self._weights = _Weights(path, gpu)
        self._model = self._weights.model
        self.vocab_size = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self._model))
        if self.vocab_size != config.vocab_size:
            raise RuntimeError(f"llama.cpp reads {self.vocab_size} tokens from {path}, the GGUF "
                               f"metadata says {config.vocab_size}")
        self.dim = C.llama_model_n_embd(self._model)
        self._all_rows = _hidden_all_rows(self._model)
        self.hidden_rows_cost_logits = self._all_rows is None
        self.capabilities = Capabilities(final_hidden=True,
                                         hidden_costs_logits=self.hidden_rows_cost_logits,
                                         greedy_many=True, curve_on_disk=True)
        self.curve = None  # forerun.profile's calibration, at its first use
        self._open_context()

    @property
    def source(self) -> Path:
        """The GGUF file it runs."""
        return self._path

    def calibration_key(self) -> dict:
        """What a measured forward-time curve depends on (`forerun.profile` caches curves on
        disk under it): this file, build (version, patch, the libraries' files), thread count,
        batch, context and machine."""
        import llama_cpp

        stat = self._path.stat()
        return {"runtime": "llama.cpp", "model": str(self._path.resolve()),
                "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                "llama_cpp": llama_cpp.__version__, "patched": not self.hidden_rows_cost_logits,
                "threads": self._threads, "batch": self.batch_size, "gpu": self._gpu,
                "capacity": self._capacity, "cpu": _cpu_name(), "libs": _library_stamp()}

    def _open_context(self, n_seq: int = MAX_TREE_LEAVES) -> None:
        """A llama.cpp context (the KV cache: sequence SEQ, and a tree pass's others; `n_seq`
        sequence ids in all) and its batches, all empty."""
        cparams = C.llama_context_default_params()
        cparams.n_ctx = self._capacity
        cparams.n_batch = cparams.n_ubatch = self.batch_size
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # one cache, shared by the sequences of a tree pass
        # llama.cpp reserves an output row per sequence and aborts the process (GGML_ASSERT)
        # when its output buffer, by default min(n_batch, n_ctx) rows, is smaller
        cparams.n_outputs_max = max(min(self.batch_size, self._capacity), n_seq)
        cparams.n_threads = cparams.n_threads_batch = self._threads
        self._ctx = C.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {self._capacity} "
                               f"tokens{_llama_errors()}")
        # the context is freed first; `self._weights` keeps the model alive until then
        weakref.finalize(self, C.llama_free, self._ctx)
        self._memory = C.llama_get_memory(self._ctx)
        self._length = 0
        # keep()'s compaction buffer: grown as needed, at most the KV cache's own size, and
        # kept (allocating it per tree step would page-fault it in each time)
        self._state = np.empty(0, dtype=np.uint8)
        self._alloc_batch(self.batch_size)

    def fork(self) -> LlamaCppRuntime:
        """One more sequence: a new context (KV cache) on the same loaded model."""
        twin = copy.copy(self)
        twin._open_context()
        twin.curve = None  # its own, measured at its first use
        return twin

    def greedy_many(self, prompts: list[list[int]], max_tokens: int, stop_ids,
                    rows: int = 8, temperature: float = 0.0, seed: int = 0
                    ) -> Iterator[tuple[int, list[int]]]:
        """Greedy replies to many prompts, `rows` sequences decoding in one batch (continuous:
        a finished sequence's slot takes the next prompt), in a context of their own; yields
        (prompt index, reply) as each ends, at a stop token (not included) or `max_tokens`.
        For bulk generation (training data): a batch of 8 rows costs ~3x one row here, so ~2.7x
        the tokens a second of one-at-a-time decoding. Each row reads only its own sequence's
        cells, but the batch shapes differ from a plain decode's, so where llama.cpp's kernels
        depend on them (see the module docstring) a reply may part from plain greedy decoding's
        at a near-tie. `temperature` > 0 samples instead (softmax of logits / temperature),
        each prompt from its own generator seeded by (seed, prompt index), so that what a
        prompt gets does not depend on the batch it shared (training data's own questions)."""
        if not 1 <= rows <= MAX_TREE_LEAVES:
            raise ValueError(f"rows must be 1..{MAX_TREE_LEAVES}")
        if not prompts:
            return
        longest = max(map(len, prompts)) + max_tokens
        if not all(prompts) or longest > self.config.context_length:
            raise ValueError(f"each prompt must be non-empty and fit with {max_tokens} reply "
                             f"tokens in the model's {self.config.context_length}-token context")
        stop = set(stop_ids)
        rows = min(rows, len(prompts))
        pool = copy.copy(self)  # the same weights, a context for `rows` sequences
        pool._capacity = rows * longest
        pool._open_context()
        queue = list(enumerate(prompts))[::-1]
        # per slot: (prompt index, reply so far, its next position); None when idle
        slots: list[tuple[int, list[int], int] | None] = [None] * rows
        rngs: dict[int, np.random.Generator] = {}

        def pick(index: int, logits: torch.Tensor) -> int:  # [V]
            if temperature <= 0:
                return int(logits.argmax())
            p = torch.softmax(logits.double() / temperature, -1).numpy()  # [V]
            return int(rngs[index].choice(p.shape[0], p=p))

        def start(slot: int) -> None:
            C.llama_memory_seq_rm(pool._memory, slot, -1, -1)
            if not queue:
                slots[slot] = None
                return
            index, ids = queue.pop()
            rngs[index] = np.random.default_rng((seed, index))
            for begin in range(0, len(ids), pool.batch_size):  # the prompt, last row's logits
                chunk = np.asarray(ids[begin:begin + pool.batch_size], dtype=np.int32)
                pool._decode_seqs(chunk, np.arange(begin, begin + chunk.shape[0]), slot, 1)
            first = pick(index, pool._read(C.llama_get_logits, 1, pool.vocab_size, 1)[0])
            slots[slot] = (index, [first], len(ids))

        for slot in range(rows):
            start(slot)
        while any(slots):
            for slot, state in enumerate(slots):  # finished ones yield and take a new prompt
                while state is not None and (state[1][-1] in stop or len(state[1]) >= max_tokens):
                    index, reply, _ = state
                    yield index, reply[:-1] if reply[-1] in stop else reply
                    start(slot)
                    state = slots[slot]
            live = [s for s in range(rows) if slots[s] is not None]
            if not live:
                break
            ids = np.array([slots[s][1][-1] for s in live], dtype=np.int32)  # [n]
            pos = np.array([slots[s][2] + len(slots[s][1]) - 1 for s in live])  # [n]
            pool._decode_seqs(ids, pos, live, len(live))
            logits = pool._read(C.llama_get_logits, len(live), pool.vocab_size, len(live))
            for s, row in zip(live, logits, strict=True):  # row: [V]
                slots[s][1].append(pick(slots[s][0], row))

    def _decode_seqs(self, ids: np.ndarray, positions: np.ndarray, seqs, outputs: int) -> None:
        """One llama_decode of rows in independent sequences (`seqs`: one id for all, or one
        per row) with outputs for the last `outputs` rows (greedy_many's passes)."""
        n = ids.shape[0]
        self._positions[:n] = positions
        self._tree_n_seq[:n] = 1
        self._tree_seqs[:n, 0] = seqs
        self._submit(self._tree_batch, ids, outputs, int(positions[0]))

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
        # a tree pass's batch: the same tokens, positions and outputs; sequences per token
        self._tree_n_seq = np.zeros(n, np.int32)
        self._tree_seqs = np.zeros((n, MAX_TREE_LEAVES), np.int32)
        row, base = self._tree_seqs.strides[0], self._tree_seqs.ctypes.data
        self._tree_seq_ids = (ctypes.POINTER(C.llama_seq_id) * n)(
            *(ctypes.cast(base + i * row, ctypes.POINTER(C.llama_seq_id)) for i in range(n)))

        def ptr(a, ctype):
            return a.ctypes.data_as(ctypes.POINTER(ctype))

        def batch(n_seq, seq_ids):
            return C.llama_batch(
                n_tokens=0, token=ptr(self._tokens, C.llama_token), embd=None,
                pos=ptr(self._positions, C.llama_pos), n_seq_id=ptr(n_seq, ctypes.c_int32),
                seq_id=seq_ids, logits=ptr(self._outputs, ctypes.c_int8))

        self._batch = batch(self._n_seq, self._seq_ids)
        self._tree_batch = batch(self._tree_n_seq, self._tree_seq_ids)
        self._tree: _TreePass | None = None  # the last forward's tree, until keep or truncate

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        """Into a tree pass: its first rows stay if they form a root-to-node path (see keep)."""
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        tree = self._tree
        if tree is not None:
            if length > tree.start:
                self.keep(tree.start, list(range(length - tree.start)))
                return
            self._drop_tree()
        if length < self._length and not C.llama_memory_seq_rm(self._memory, SEQ, length, -1):
            raise RuntimeError(f"llama.cpp could not remove cache positions >= {length}")
        self._length = length

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep rows (a root-to-node path) of the tree pass at `start`: their cells join sequence
        SEQ at their positions start.., which are already contiguous; the rest of the tree is
        freed, and a path that skipped rows is compacted (`_compact`). After a chain forward,
        rows 0..n-1 only: truncate(start + n)."""
        rows, tree = [int(r) for r in rows], self._tree
        leading = rows == list(range(len(rows)))  # the pass's first rows: no cells between
        if tree is None:
            end = start + len(rows)
            if not leading or not 0 <= start <= end <= self._length:
                raise ValueError(f"after a chain forward only rows 0..n-1 can be kept, within the "
                                 f"{self._length} cached tokens; got rows {rows} at {start}")
            self.truncate(end)
            return
        seq = tree.path_sequence(rows)
        if start != tree.start or seq is None:
            raise ValueError(f"rows {rows} at {start} are not a root-to-node path of the tree "
                             f"pass at {tree.start}: llama.cpp keeps one branch")
        end = start + len(rows)
        if seq != SEQ:
            C.llama_memory_seq_rm(self._memory, SEQ, start, -1)
            C.llama_memory_seq_cp(self._memory, seq, SEQ, start, end)
        self._drop_tree()
        C.llama_memory_seq_rm(self._memory, SEQ, end, -1)
        self._length = end
        if not leading:  # freed branch cells lie between the path's
            self._compact()

    def _compact(self) -> None:
        """Rewrite sequence SEQ into contiguous cells in position order, as plain decoding
        leaves it. After keep() of a path that skipped rows, the dropped branches' cells are
        holes between the path's, and llama.cpp puts the next tokens into them, before cells of
        earlier positions. Its CPU flash attention sums values in cell order at half precision,
        so every later logit would move (up to ~0.6 on the default target, measured): not plain
        greedy's to the bit. The sequence's cells are copied out (K/V bytes and positions, in
        cell order, which is still position order here) and back into one free run: ~28 KB a
        cached token for the default target, 1.4 ms median over 85 tree steps and 6.5 ms at
        819 cached tokens on a 2-core Zen 3."""
        size = C.llama_state_seq_get_size(self._ctx, SEQ)
        if self._state.size < size:
            self._state = np.empty(size, dtype=np.uint8)
        buf = self._state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = C.llama_state_seq_get_data(self._ctx, buf, size, SEQ)
        C.llama_memory_seq_rm(self._memory, SEQ, -1, -1)
        if not written or C.llama_state_seq_set_data(self._ctx, buf, written, SEQ) != written:
            C.llama_memory_seq_rm(self._memory, SEQ, -1, -1)
            self._length = 0
            raise RuntimeError(f"llama.cpp could not rewrite the KV cache after a tree step "
                               f"(cache emptied: prefill again){_llama_errors()}")

    def _drop_tree(self) -> None:
        """Forget the tree's other sequences; cells no sequence holds any more are freed."""
        C.llama_memory_seq_keep(self._memory, SEQ)
        self._tree = None

    def forward(self, tokens, *, positions=None, tree_mask=None, last_only=False,
                hidden_layers=(), hidden_from=0) -> ForwardOutput:
        start, T = self._length, tokens.shape[0]
        if start + T > self._capacity:
            raise ValueError(f"context full: {start} + {T} tokens > capacity {self._capacity}")
        if self._tree is not None:
            raise ValueError(f"the tree pass at {self._tree.start} is unresolved: keep() its "
                             "accepted path (or truncate) before the next forward")
        tree = None if positions is None and tree_mask is None else self._tree_pass(
            start, T, positions, tree_mask)
        unavailable = sorted(set(hidden_layers) - {FINAL_NORMED})
        if unavailable:
            raise NotImplementedError(
                f"llama.cpp exposes only the final normed hidden state (layer -1), "
                f"not layers {unavailable}")
        want_hidden = FINAL_NORMED in hidden_layers
        # every row's state without its logits (the patch) where only the last row's are wanted;
        # else llama.cpp's embeddings, which come only with every row an output
        all_rows = self._all_rows if want_hidden and last_only else None
        ids = np.asarray(tokens.cpu(), dtype=np.int32)  # [T]
        if T and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        logits, hidden = [], []
        try:
            for seq in range(SEQ + 1, SEQ + tree.leaves) if tree else ():
                C.llama_memory_seq_cp(self._memory, SEQ, seq, -1, -1)  # the committed cache
            for begin in range(0, T, self.batch_size):
                end = min(T, begin + self.batch_size)
                # a chunk wholly before hidden_from computes no hidden rows (with the patch,
                # the last layer's FFN over every row of it); the chunks stay plain's
                wants = want_hidden and end > hidden_from
                self._hidden_mode(want_hidden, all_rows, wants, hidden_from - begin)
                keep = (1 if end == T else 0) if last_only else end - begin
                rows = end - begin if wants and not all_rows else keep
                self._decode(ids[begin:end], start + begin, rows, tree)
                if keep:
                    logits.append(self._read(C.llama_get_logits, rows, self.vocab_size, keep))
                if wants and all_rows:  # the rows from hidden_from on (the others: not made)
                    hidden.append(self._read(all_rows[1], end - begin, self.dim,
                                             end - max(begin, hidden_from)))
                elif wants:  # every row, even under last_only (a head's prefill needs them)
                    hidden.append(self._read(C.llama_get_embeddings, rows, self.dim, rows))
        except BaseException:
            if tree:
                C.llama_memory_seq_keep(self._memory, SEQ)
            C.llama_memory_seq_rm(self._memory, SEQ, start, -1)  # forget the partial chunks
            raise
        finally:
            self._hidden_mode(want_hidden, all_rows, False)
        self._length, self._tree = start + T, tree
        out = ForwardOutput(_joined(logits, self.vocab_size))  # [T, V] ([1, V] if last_only)
        if want_hidden:  # [T - hidden_from, D]: the chunks' rows from hidden_from on
            rows = _joined(hidden, self.dim)
            out.hidden[FINAL_NORMED] = rows[rows.shape[0] - max(0, T - hidden_from):]
        return out

    def _hidden_mode(self, want_hidden: bool, all_rows: tuple | None, on: bool,
                     first_row: int = 0) -> None:
        """Hidden states on or off for the next decode; with the patch's all-rows states, of
        the batch's rows from first_row on (where the build can skip the others)."""
        if all_rows:
            all_rows[0](self._ctx, on)
            if all_rows[2] is not None:
                all_rows[2](self._ctx, max(0, first_row) if on else 0)
        elif want_hidden:
            C.llama_set_embeddings(self._ctx, on)

    def _tree_pass(self, start: int, T: int, positions, tree_mask) -> _TreePass | None:
        """The sequences of a tree forward, or None for a chain (a tree of one leaf is one);
        checks that positions are start + depth, which is where llama.cpp puts the rows."""
        if tree_mask is not None and tuple(tree_mask.shape) != (T, T):
            raise ValueError(f"tree_mask is {tuple(tree_mask.shape)} for {T} tokens")
        tree = _TreePass.of(start, tree_mask) if tree_mask is not None and T else None
        if tree is not None and tree.leaves > MAX_TREE_LEAVES:
            raise ValueError(f"a tree pass on llama.cpp has at most {MAX_TREE_LEAVES} leaves "
                             f"(one sequence each); this tree has {tree.leaves}")
        depth = torch.arange(T) if tree is None else torch.from_numpy(tree.depth).long()  # [T]
        slots = torch.arange(T) if positions is None else positions.cpu().long() - start  # [T]
        if not torch.equal(slots, depth):
            raise NotImplementedError(
                "llama.cpp puts each row at start + its depth in the tree (tree_mask; a chain "
                "without one), which the positions (default: the slots) must be")
        return tree if tree is not None and tree.leaves > 1 else None

    def _decode(self, ids: np.ndarray, start: int, rows: int, tree: _TreePass | None) -> None:
        """One llama_decode over ids at slots start.., with outputs for the last `rows`: a chain
        in sequence SEQ, or those rows of a tree pass, at their depths, in their sequences."""
        n = ids.shape[0]
        batch = self._batch
        if tree is None:
            self._positions[:n] = np.arange(start, start + n, dtype=np.int32)
        else:
            batch, first = self._tree_batch, start - tree.start
            self._positions[:n] = tree.start + tree.depth[first:first + n]
            self._tree_n_seq[:n] = tree.n_seq[first:first + n]
            self._tree_seqs[:n, :tree.leaves] = tree.seq_ids[first:first + n]
        self._submit(batch, ids, rows, start)

    def _submit(self, batch, ids: np.ndarray, rows: int, start: int) -> None:
        """llama_decode of `batch` (positions and sequences filled in) over ids, with outputs
        for the last `rows`."""
        n = ids.shape[0]
        self._tokens[:n] = ids
        self._outputs[:n - rows] = 0
        self._outputs[n - rows:n] = 1
        self._run(batch, n, start)

    def _run(self, batch, n: int, start: int) -> None:
        """llama_decode of the first n rows of `batch` (tokens, positions, sequences and output
        flags filled in); llama.cpp's refusals become our errors."""
        batch.n_tokens = n
        _errors.clear()
        code = C.llama_decode(self._ctx, batch)
        if code == DECODE_NO_SLOT:
            raise ValueError(f"llama.cpp found no KV cache room for {n} tokens at {start}")
        if code != DECODE_OK:
            raise RuntimeError(f"llama_decode failed with code {code}{_llama_errors()}")

    def _read(self, getter, rows: int, width: int, keep: int) -> torch.Tensor:
        """Copy the last `keep` of the last decode's `rows` output rows out of llama.cpp's buffer
        ([rows, width] float32, overwritten by the next decode): the only copy a forward makes."""
        view = np.ctypeslib.as_array(getter(self._ctx), shape=(rows, width))
        return torch.from_numpy(view[rows - keep:].copy())  # [keep, width]
