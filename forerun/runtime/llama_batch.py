"""Many sequences, one llama.cpp context: the BatchRuntime (`forerun.runtime.batch`) over
llama.cpp, so that a batch's pass reads the quantized weights once for every member.

Owns: `BatchLlamaRuntime`, built from a `LlamaCppRuntime` (its loaded model is shared; its own
one-sequence context is left alone, and is `single`, the one-sequence view a drafter's cost
curve is measured on). One llama.cpp context whose n_ctx cells are the pool: `add` reserves a
sequence's most tokens against them (PoolFull when they, or the sequence ids, are taken).

Sequence ids: 0 .. max_seqs-1 are requests (a handle is its id); GARBAGE (= max_seqs) holds
cells no sequence sees any more; the ids above are a shared pool of scratch sequences for the
tree leaves of one pass. Each member of a PackedBatch is its sequence, its tokens at its cache
length + 0..T-1 (a chain) or + its tree's depths; leaf 0 of a tree is the member itself, each
further leaf a scratch sequence that first gets the member's committed cache (`seq_cp`: a
sequence id added to its cells), as `LlamaCppRuntime` does with its leaves 1..; `commit` moves
the accepted path into the member and frees the scratch ids.

Invariants, for logits that do not depend on the batch a sequence shares:
- cells are appended, never reused before a collection: nothing is freed (a dropped token,
  branch or released sequence is moved to GARBAGE, `seq_cp` then `seq_rm`), so llama.cpp's
  head always lies above every used cell and each new token's cell above all of its
  sequence's. Every sequence's cells are then in position order, as in a one-sequence cache,
  and llama.cpp's CPU flash attention, which skips other sequences' (masked) cells and sums
  its own in cell order, computes each row as it would alone (freed cells, which llama.cpp
  refills first, moved a SmolLM2-135M pass's logits by up to 0.97, measured). A tree's
  accepted path needs no `_compact` either: its cells already ascend. Every row's attention
  scans every cell below the top, garbage included, so when the garbage outgrows the live
  cells (or the cells run out) `_collect` copies every sequence out, clears the cache and
  writes them back contiguous (a copy of the live KV).
- a pass runs as llama_decode calls of at most `exact_rows` rows (EXACT_ROWS = 48): under
  forerun's patches llama.cpp's matmuls give every row of such a call the one-token kernels'
  result, and under GGML_FA_TILE_Q (64) rows the flash attention is per row. So a member's
  logits equal, to the bit, those of the same tokens decoded alone or one token a call,
  whatever it is batched with (tests/test_llama_batch.py). `LlamaCppRuntime` prefills in
  calls of EXACT_ROWS too, so a sequence decoded alone (`forerun generate`) and in a batch
  agree. `exact_rows=0` takes n_batch-row calls instead (fewer weight reads for big batches;
  rows then round by call shape).
Not exact: a pass of one row at >= 512 cells on a machine with more threads than heads takes
llama.cpp's split-KV attention (see patches/*-avx2.patch), so there a one-member pass rounds
unlike a batched one. Hidden states are not returned (no heads in batches yet).
Never samples, never tokenizes.
"""

from __future__ import annotations

import copy
import ctypes
from dataclasses import dataclass

import numpy as np
import torch
from llama_cpp import llama_cpp as C

from forerun.runtime.base import ForwardOutput
from forerun.runtime.batch import Capabilities, PackedBatch, PoolFull
from forerun.runtime.llama_cpp import (
    EXACT_ROWS,
    MAX_TREE_LEAVES,
    LlamaCppRuntime,
    _llama_errors,
    _TreePass,
)

MAX_SEQS = 32  # request sequences in one context (Capabilities.max_batch)
SCRATCH_SEQS = 64  # tree leaves beyond each member's first, over all members of one pass
KV_BYTES_PER_VALUE = 2  # llama.cpp's default f16 K and V cache
MIN_GARBAGE = 256  # cells of garbage always tolerated (llama.cpp pads its scan to 256 cells)
ALL = -1  # llama_memory_seq_* position bound: to the end (or from the start)


@dataclass
class _Sequence:
    reserved: int
    length: int = 0


@dataclass(frozen=True)
class SavedCells:
    """Some of a member's cached slots as llama.cpp saves a sequence's cells (positions and
    f16 K and V), for a prefix cache."""

    data: np.ndarray  # [bytes] uint8
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class _Tree:
    """A member's unresolved tree pass: its leaf j is sequence ids[j] (ids[0] the member)."""

    tree: _TreePass
    ids: list[int]


def kv_bytes_per_token(runtime: LlamaCppRuntime) -> int:
    cfg = runtime.config
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * KV_BYTES_PER_VALUE


class BatchLlamaRuntime:
    """A llama.cpp context holding many sequences: `forward(batch)` runs one pass for all."""

    def __init__(self, runtime: LlamaCppRuntime, cells: int, *, max_seqs: int = MAX_SEQS,
                 scratch: int = SCRATCH_SEQS, exact_rows: int = EXACT_ROWS):
        if cells < 1:
            raise ValueError(f"a batched llama.cpp context needs at least one cell, got {cells}")
        self.single, self.config = runtime, runtime.config
        self.cells = cells
        self.capacity = min(runtime.capacity, runtime.config.context_length, cells)
        self.capabilities = Capabilities(hidden_layers=False, reduced_vocab=False,
                                         cuda_graphs=False, tree_masks=True,
                                         hidden_costs_logits=True, max_batch=max_seqs,
                                         kv_grow=True, kv_copy=True)
        self.garbage = max_seqs
        self._ctx = copy.copy(runtime)  # the same weights, a context of its own
        self._ctx._capacity = cells
        self._ctx.batch_size = min(exact_rows or runtime.batch_size, cells)
        self._ctx._open_context(n_seq=max_seqs + 1 + scratch)
        self._memory = self._ctx._memory
        self._free_ids = list(range(max_seqs))[::-1]  # pop() takes the lowest
        self._free_scratch = list(range(max_seqs + 1, max_seqs + 1 + scratch))[::-1]
        self._seqs: dict[int, _Sequence] = {}
        self._trees: dict[int, _Tree] = {}
        self._top = 0  # cells appended since the last collection: all below are in use
        self._taken = self._peak = 0  # cells reserved now, and the most since a reset
        self.collections = 0  # times the garbage was freed (`_collect`)

    @classmethod
    def with_budget(cls, runtime: LlamaCppRuntime, budget_bytes: int, **kw) -> BatchLlamaRuntime:
        """A context of as many cells as `budget_bytes` of f16 K and V hold."""
        per_token = kv_bytes_per_token(runtime)
        if budget_bytes < per_token:
            raise ValueError(f"a cache budget of {budget_bytes} bytes holds no token "
                             f"({per_token} bytes each)")
        return cls(runtime, budget_bytes // per_token, **kw)

    # --- sequences ------------------------------------------------------------------------

    def add(self, tokens: int) -> int:
        if tokens < 1:
            raise ValueError(f"a sequence needs at least one slot, got {tokens}")
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context "
                             f"{self.capacity}")
        if not self._free_ids or self._taken + tokens > self.cells:
            raise PoolFull(f"no room for a sequence of {tokens} tokens ({self.cells - self._taken}"
                           f" of {self.cells} cells, {len(self._free_ids)} sequence ids free)")
        seq = self._free_ids.pop()
        self._seqs[seq] = _Sequence(tokens)
        self._taken += tokens
        self._peak = max(self._peak, self._taken)
        return seq

    def release(self, seq: int) -> None:
        self._drop_tree(seq)
        self._discard(seq, 0)
        self._taken -= self._seqs.pop(seq).reserved
        self._free_ids.append(seq)
        self._free_ids.sort(reverse=True)

    def grow(self, seq: int, tokens: int) -> None:
        """Let a member cache up to `tokens` tokens: more of the context's cells reserved for it
        (cells are appended wherever they are free, so nothing moves); PoolFull when the cells
        are taken."""
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context "
                             f"{self.capacity}")
        s = self._seqs[seq]
        more = tokens - s.reserved
        if more <= 0:
            return
        if self._taken + more > self.cells:
            raise PoolFull(f"no room to grow a sequence to {tokens} tokens "
                           f"({self.cells - self._taken} of {self.cells} cells free)")
        s.reserved, self._taken = tokens, self._taken + more
        self._peak = max(self._peak, self._taken)

    def length(self, seq: int) -> int:
        return self._seqs[seq].length

    def reserved(self, seq: int) -> int:
        return self._seqs[seq].reserved

    def kv_bytes(self) -> int:
        return self._taken * kv_bytes_per_token(self.single)

    def kv_peak_bytes(self, reset: bool = False) -> int:
        peak = self._peak * kv_bytes_per_token(self.single)
        if reset:
            self._peak = self._taken
        return peak

    def truncate(self, seq: int, length: int) -> None:
        """Into a tree pass: its first rows stay if they form a root-to-node path."""
        s = self._seqs[seq]
        if not 0 <= length <= s.length:
            raise ValueError(f"cannot truncate a cache of {s.length} tokens to {length}")
        pending = self._trees.get(seq)
        if pending is not None and length > pending.tree.start:
            self.commit(seq, pending.tree.start, list(range(length - pending.tree.start)))
            return
        self._drop_tree(seq)
        self._discard(seq, length)
        s.length = length

    def commit(self, seq: int, base: int, rows: list[int]) -> None:
        """Keep the last pass's rows `rows` (a chain's first rows, or a tree's root-to-node
        path) as slots base..; the rest of the pass becomes garbage."""
        s, rows = self._seqs[seq], [int(r) for r in rows]
        end = base + len(rows)
        pending = self._trees.pop(seq, None)
        if pending is None:
            if rows != list(range(len(rows))) or not 0 <= base <= end <= s.length:
                raise ValueError(f"after a chain pass only rows 0..n-1 can be kept, within the "
                                 f"{s.length} cached tokens; got rows {rows} at {base}")
            self._discard(seq, end)
            s.length = end
            return
        leaf = pending.tree.path_sequence(rows)
        if base != pending.tree.start or leaf is None:
            self._trees[seq] = pending
            raise ValueError(f"rows {rows} at {base} are not a root-to-node path of the tree "
                             f"pass at {pending.tree.start}")
        for sid in pending.ids:  # every cell of the pass stays in use until a collection
            C.llama_memory_seq_cp(self._memory, sid, self.garbage, base, ALL)
        if leaf != 0:
            C.llama_memory_seq_rm(self._memory, seq, base, ALL)
            C.llama_memory_seq_cp(self._memory, pending.ids[leaf], seq, base, end)
        C.llama_memory_seq_rm(self._memory, seq, end, ALL)
        self._free_leaves(pending)
        s.length = end

    def _discard(self, seq: int, length: int) -> None:
        """Positions >= length leave the sequence; their cells stay in use (GARBAGE's)."""
        C.llama_memory_seq_cp(self._memory, seq, self.garbage, length, ALL)
        C.llama_memory_seq_rm(self._memory, seq, length, ALL)

    def _drop_tree(self, seq: int) -> None:
        """Forget an unresolved tree pass's leaves (their cells become garbage)."""
        pending = self._trees.pop(seq, None)
        if pending is not None:
            for sid in pending.ids:
                C.llama_memory_seq_cp(self._memory, sid, self.garbage, pending.tree.start, ALL)
            self._free_leaves(pending)

    def _free_leaves(self, pending: _Tree) -> None:
        for sid in pending.ids[1:]:
            C.llama_memory_seq_rm(self._memory, sid, ALL, ALL)  # frees nothing: shared cells
            self._free_scratch.append(sid)

    # --- the pass -------------------------------------------------------------------------

    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """-> logits [R, V] float32 of batch.logit_rows (every row when None); no hidden
        states (Capabilities.hidden_layers is False)."""
        if hidden_layers:
            raise NotImplementedError("the batched llama.cpp runtime returns no hidden states")
        n = batch.tokens.shape[0]
        ids = np.asarray(batch.tokens.cpu(), dtype=np.int32)  # [N]
        if n and (ids.min() < 0 or ids.max() >= self.single.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.single.vocab_size})")
        self._check(batch)
        live = sum(s.length for s in self._seqs.values())
        if self._top + n > self.cells or self._top - live > max(live, MIN_GARBAGE):
            self._collect()
        positions, n_seq, seqs, trees = self._layout(batch)  # [N], [N], [N, W]
        wanted = np.zeros(n, np.int8)
        rows = (np.arange(n) if batch.logit_rows is None
                else np.asarray(batch.logit_rows.cpu(), dtype=np.int64))  # [R]
        wanted[rows] = 1
        chunks = []
        try:
            for t in trees.values():
                for sid in t.ids[1:]:  # each further leaf starts from the committed cache
                    C.llama_memory_seq_cp(self._memory, t.ids[0], sid, ALL, ALL)
            step = self._ctx.batch_size
            for begin in range(0, n, step):
                end = min(n, begin + step)
                self._decode(ids[begin:end], positions[begin:end], n_seq[begin:end],
                             seqs[begin:end], wanted[begin:end])
                self._top += end - begin
                outputs = int(wanted[begin:end].sum())
                if outputs:
                    chunks.append(self._ctx._read(C.llama_get_logits, outputs,
                                                  self.single.vocab_size, outputs))
        except BaseException:
            for seq in batch.seqs:  # forget the partial pass
                if seq in trees:
                    self._trees[seq] = trees[seq]
                    self._drop_tree(seq)
                self._discard(seq, self._seqs[seq].length)
            raise
        for b, seq in enumerate(batch.seqs):
            self._seqs[seq].length += batch.cu[b + 1] - batch.cu[b]
        self._trees.update(trees)
        logits = (torch.cat(chunks) if len(chunks) > 1 else chunks[0] if chunks
                  else torch.empty(0, self.single.vocab_size))  # [R sorted, V]
        order = np.searchsorted(np.flatnonzero(wanted), rows)  # [R]
        if not np.array_equal(order, np.arange(len(order))):
            logits = logits[torch.from_numpy(order)]
        return ForwardOutput(logits)

    def _check(self, batch: PackedBatch) -> None:
        if len(set(batch.seqs)) != batch.size:
            raise ValueError(f"a sequence may appear once in a pass: {batch.seqs}")
        for b, seq in enumerate(batch.seqs):
            s = self._seqs.get(seq)
            if s is None:
                raise ValueError(f"sequence {seq} is not in the pool")
            if seq in self._trees:
                raise ValueError(f"sequence {seq}: the tree pass at {self._trees[seq].tree.start}"
                                 " is unresolved: commit its accepted path first")
            t = batch.cu[b + 1] - batch.cu[b]
            if s.length + t > s.reserved:
                raise ValueError(f"sequence {seq}: {s.length} + {t} tokens exceed its "
                                 f"{s.reserved} reserved slots")

    def _layout(self, batch: PackedBatch):
        """Each row's position, sequence count and sequence ids (a chain's row: its member;
        a tree's: the leaves whose paths hold it), and the members' tree passes."""
        n = batch.tokens.shape[0]
        positions = np.zeros(n, np.int32)
        n_seq = np.ones(n, np.int32)
        seqs = np.zeros((n, MAX_TREE_LEAVES), np.int32)
        trees: dict[int, _Tree] = {}
        free = list(self._free_scratch)
        for b, seq in enumerate(batch.seqs):
            lo, hi = batch.cu[b], batch.cu[b + 1]
            start, t = self._seqs[seq].length, hi - lo
            mask = batch.tree_masks[b] if batch.tree_masks is not None else None
            tree = None
            if mask is not None and t:
                if tuple(mask.shape) != (t, t):
                    raise ValueError(f"sequence {seq}: tree mask {tuple(mask.shape)} for {t} "
                                     "tokens")
                tree = _TreePass.of(start, mask)
                if tree.leaves > MAX_TREE_LEAVES:
                    raise ValueError(f"a tree on llama.cpp has at most {MAX_TREE_LEAVES} leaves"
                                     f" (one sequence each); sequence {seq}'s has {tree.leaves}")
            depth = np.arange(t) if tree is None else tree.depth  # [T]
            if batch.positions is not None and not np.array_equal(
                    np.asarray(batch.positions[lo:hi].cpu()), depth):
                raise NotImplementedError(
                    "llama.cpp puts each row at its cache length + its depth in the tree, "
                    "which the positions must be")
            positions[lo:hi] = start + depth
            seqs[lo:hi, 0] = seq
            if tree is not None and tree.leaves > 1:
                if len(free) < tree.leaves - 1:
                    raise ValueError(f"the pass's trees need more than the "
                                     f"{len(self._free_scratch)} scratch sequences of this "
                                     "context (scratch=)")
                leaf_ids = [seq, *(free.pop() for _ in range(tree.leaves - 1))]
                n_seq[lo:hi] = tree.n_seq
                seqs[lo:hi, :tree.leaves] = np.asarray(leaf_ids, np.int32)[tree.seq_ids]
                trees[seq] = _Tree(tree, leaf_ids)
        self._free_scratch = free
        return positions, n_seq, seqs, trees

    def _decode(self, ids, positions, n_seq, seqs, wanted) -> None:
        """One llama_decode of up to batch_size rows, in the context's preallocated batch."""
        ctx, n = self._ctx, ids.shape[0]
        ctx._tokens[:n] = ids
        ctx._positions[:n] = positions
        ctx._outputs[:n] = wanted
        ctx._tree_n_seq[:n] = n_seq
        ctx._tree_seqs[:n] = seqs
        ctx._run(ctx._tree_batch, n, int(positions[0]))

    def _collect(self) -> None:
        """Free the garbage: every sequence copied out (in cell order, which is position order),
        the cache cleared, and each written back into contiguous cells."""
        if self._trees:
            raise RuntimeError("cannot collect the KV cache with a tree pass unresolved")
        saved = [(seq, self._save(seq)) for seq, s in self._seqs.items() if s.length]
        C.llama_memory_clear(self._memory, False)
        self._top = 0
        self.collections += 1
        for seq, data in saved:
            if not self._restore(data, seq):
                C.llama_memory_clear(self._memory, False)
                for s in self._seqs.values():
                    s.length = 0
                raise RuntimeError(f"llama.cpp could not rewrite the KV cache (every sequence "
                                   f"emptied: prefill again){_llama_errors()}")
            self._top += self._seqs[seq].length

    def _save(self, seq: int) -> np.ndarray:
        """The sequence's cells as llama.cpp serialises them (positions, K, V) [bytes] uint8."""
        size = C.llama_state_seq_get_size(self._ctx._ctx, seq)
        buf = np.empty(size, dtype=np.uint8)
        written = C.llama_state_seq_get_data(
            self._ctx._ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq)
        return buf[:written]

    def _restore(self, data: np.ndarray, seq: int) -> bool:
        """Write saved cells into new cells of (empty) sequence `seq` -> whether it worked."""
        ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return bool(data.size) and C.llama_state_seq_set_data(
            self._ctx._ctx, ptr, data.size, seq) == data.size

    # --- prefix caching -------------------------------------------------------------------

    def read_kv(self, seq: int, start: int, stop: int) -> SavedCells:
        """The member's cached slots start..stop, saved (a prefix cache keeps them): they are
        lent to a scratch sequence (`seq_cp` shares cells, copies nothing) and serialised."""
        s = self._seqs[seq]
        if not 0 <= start < stop <= s.length:
            raise ValueError(f"slots {start}..{stop} are not cached ({s.length} are)")
        tmp = self._scratch()
        try:
            C.llama_memory_seq_cp(self._memory, seq, tmp, start, stop)
            return SavedCells(self._save(tmp), stop - start)
        finally:
            C.llama_memory_seq_rm(self._memory, tmp, ALL, ALL)  # frees nothing: shared cells
            self._free_scratch.append(tmp)

    def write_kv(self, seq: int, blocks: list[SavedCells]) -> None:
        """Make the saved blocks, in order, the (empty) member's first cached slots: each is
        restored into new cells on top of the cache, so its cells still ascend by position,
        then handed to the member. Their K and V are the bytes a prefill would write."""
        s, n = self._seqs[seq], sum(b.tokens for b in blocks)
        if s.length or n > s.reserved:
            raise ValueError(f"{n} saved slots need an empty member reserving them "
                             f"({s.length} cached, {s.reserved} reserved)")
        if self._top + n > self.cells:
            self._collect()
        tmp = self._scratch()
        try:
            for b in blocks:
                if not self._restore(b.data, tmp):
                    raise RuntimeError(f"llama.cpp could not restore saved cells"
                                       f"{_llama_errors()}")
                C.llama_memory_seq_cp(self._memory, tmp, seq, ALL, ALL)
                C.llama_memory_seq_rm(self._memory, tmp, ALL, ALL)
                self._top += b.tokens
                s.length += b.tokens
        except RuntimeError:
            self._discard(seq, 0)
            s.length = 0
            raise
        finally:
            C.llama_memory_seq_rm(self._memory, tmp, ALL, ALL)
            self._free_scratch.append(tmp)

    def _scratch(self) -> int:
        if not self._free_scratch:
            raise RuntimeError("no scratch sequence free (a tree pass holds them all)")
        return self._free_scratch.pop()
