"""Many sequences, one target pass: the packed batch, the KV cache pool and the torch runtime
over both (the seam the batch-first engine is built on).

Owns: `PackedBatch`, the whole contract of one batched pass (vLLM's `SpecDecodeMetadata` is the
model: flattened tokens, per-member offsets, positions, tree masks, and the rows whose logits
are wanted); `CachePool`, KV memory for many sequences sized by a byte budget; and
`BatchTorchRuntime`, which runs a packed batch through our Transformer. (`Capabilities`, what a
runtime can do, lives in `runtime.base` and is imported from here too.)

The pool hands each sequence one contiguous region of cache slots, reserved at admission for
what it can ever hold (prompt + new tokens + one verify pass of slack), from one buffer per
layer: memory is a byte budget shared by whatever mix of long and short sequences is running,
not slots x context. A region's slot i holds the sequence's i-th cached token, so attention
reads a region in place (no gather), and rollback is setting the length, as in the one-sequence
runtime. A pass over several sequences runs every matmul once over all their rows (the weights
are read once: the whole point of batching on a CPU) and attention per sequence over its own
region; a row's attention never sees another sequence.

    buffer (per layer)  | seq 3 ...........|    free    | seq 1 .....| seq 7 ....... |  free  |
                          ^start  ^length   ^start+size

Decode-sized passes (a few new tokens a member) may run in static shapes instead, replayed as
CUDA graphs on a GPU (`forerun.runtime.batch_static`): the pool keeps one spare slot past every
region for their padded rows to write.

Early exit's KV reuse (`capabilities.resume_rows`): a member's draft runs the first E blocks
over its own region (`lower`), and a pass takes its draft rows from layer E on
(`PackedBatch.resume`, `forerun.runtime.batch_resume`).

Invariants: a member's new tokens are written at region slots length .. length+T-1 and the
length advances by T; `commit(seq, base, rows)` keeps the pass's rows `rows` (ascending: the
pending token and an accepted path) as slots base.. and drops the rest (a chain's accepted rows
are a prefix: the compaction is then a no-op). Never samples, never tokenizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from forerun.runtime.base import Capabilities, ForwardOutput, Resume
from forerun.runtime.batch_resume import resumed_layers
from forerun.runtime.batch_static import BatchStaticPasses
from forerun.runtime.memory import lazy_zeros, release_slots
from forerun.runtime.torch_model import TorchRuntime, attend, attend_rows, rms_norm, rope_tables


class PoolFull(RuntimeError):
    """The cache pool has no free region large enough: queue the request, or refuse it."""


@dataclass(frozen=True)
class PackedBatch:
    """One pass over several sequences. Member b feeds tokens[cu[b]:cu[b+1]] to sequence
    seqs[b], appended at its cache length (positions: that length onwards for a chain, or its
    tree's depths offset by that length); tree_masks[b] is its [T_b, T_b] mask among its new
    tokens (None = causal). `logit_rows` are the flattened rows whose logits are wanted (None
    = every row): a prefill wants only its last row, a verify every row of its draft."""

    seqs: tuple[int, ...]  # [B] sequence handles of the pool
    tokens: torch.Tensor  # [N] int64, the members' new tokens one after another
    cu: tuple[int, ...]  # [B+1] member b's rows are cu[b] .. cu[b+1]-1
    positions: torch.Tensor | None = None  # [N] absolute positions; None = chains
    tree_masks: tuple[torch.Tensor | None, ...] | None = None  # [B] of [T_b, T_b] bool or None
    logit_rows: torch.Tensor | None = None  # [R] int64 rows of the N; None = all N
    # [B] member b's first rows resumed at a layer (early exit's draft rows), or None; None =
    # no member's (a runtime without capabilities.resume_rows never gets one)
    resume: tuple[Resume | None, ...] | None = None

    @staticmethod
    def of(members: list[tuple[int, torch.Tensor]], *, last_only: bool = False,
           positions: list[torch.Tensor | None] | None = None,
           tree_masks: list[torch.Tensor | None] | None = None) -> PackedBatch:
        """Pack (seq, tokens [T_b]) members; `positions` per member are relative to the
        member's own cache length (a tree's depths), None = a chain."""
        cu = [0]
        for _, toks in members:
            cu.append(cu[-1] + len(toks))
        tokens = torch.cat([t for _, t in members]) if members else torch.empty(0, dtype=torch.long)
        rows = torch.tensor([c - 1 for c in cu[1:]]) if last_only else None  # [B]
        rel = None
        if positions is not None and any(p is not None for p in positions):
            rel = torch.cat([p if p is not None else torch.arange(len(t))
                             for p, (_, t) in zip(positions, members, strict=True)])
        masks = tuple(tree_masks) if tree_masks is not None else None
        return PackedBatch(tuple(s for s, _ in members), tokens.long(), tuple(cu), rel, masks,
                           rows)

    @property
    def size(self) -> int:
        return len(self.seqs)

    def rows_of(self, b: int) -> slice:
        return slice(self.cu[b], self.cu[b + 1])


class BatchRuntime(Protocol):
    """What the batch step asks of a backend holding many sequences (torch: BatchTorchRuntime;
    llama.cpp: its batched context)."""

    capacity: int  # the most tokens one sequence may hold (prompt + output)
    capabilities: Capabilities

    def add(self, tokens: int) -> int:
        """A new sequence that will cache at most `tokens` tokens -> its handle (PoolFull when
        the memory for it is not free now)."""
        ...

    def release(self, seq: int) -> None: ...

    def length(self, seq: int) -> int:
        """Tokens in the sequence's cache."""
        ...

    def reserved(self, seq: int) -> int:
        """The most tokens the sequence's cache may hold (what `add` reserved)."""
        ...

    def commit(self, seq: int, base: int, rows: list[int]) -> None:
        """Keep the last pass's rows `rows` of the sequence (ascending) as slots base..; drop
        the rest of that pass."""
        ...

    def truncate(self, seq: int, length: int) -> None: ...

    def kv_peak_bytes(self, reset: bool = False) -> int:
        """The most KV-cache bytes reserved at once since the last reset (`reset`: start a
        new high-water mark after reading this one)."""
        ...

    def kv_bytes(self) -> int:
        """KV-cache bytes reserved now (by the sequences held)."""
        ...

    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """One pass over every member -> logits [R, V] of batch.logit_rows (every row when
        None), on the runtime's device (the step takes one argmax there and copies a sampled
        member's rows only), and hidden states layer -> [N, D]."""
        ...


@dataclass
class Region:
    start: int  # first slot of the region in the pool's buffer
    size: int  # slots reserved
    length: int = 0  # slots holding cached tokens


# one member's rows of a block pass: (its region's first slot, the rows' first slot in the
# region, their count T, their mask [T, S_b] bool or None)
MemberRows = tuple[int, int, int, torch.Tensor | None]

SPARE_SLOTS = 1  # past the S regions' slots: where a static pass's padded rows write


@dataclass(frozen=True)
class KVCopy:
    """Copies of some of a member's cached slots: keys and values [L, Hkv, n, hd] each."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class CachePool:
    """KV memory for many sequences: one [L, Hkv, S + 1, hd] key and value buffer sized by a
    byte budget, its S slots handed out as contiguous regions (first fit; freed regions merge
    with their neighbours), the last one spare (a static pass's padding)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, budget_bytes: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.bytes_per_token = 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize
        self.slots = budget_bytes // self.bytes_per_token
        if self.slots < 1:
            raise ValueError(f"a cache budget of {budget_bytes} bytes holds no token "
                             f"({self.bytes_per_token} bytes each)")
        shape = (n_layers, n_kv_heads, self.slots + SPARE_SLOTS, head_dim)
        self.k = lazy_zeros(shape, dtype, device)  # pages resident once written: RSS follows
        self.v = lazy_zeros(shape, dtype, device)  # the slots in use, not the budget
        self._free: list[tuple[int, int]] = [(0, self.slots)]  # (start, size), by start
        self._regions: dict[int, Region] = {}
        self._next = 0
        self.peak_slots = 0  # high-water mark of reserved slots

    def allocate(self, tokens: int) -> int:
        """A new sequence that can cache up to `tokens` tokens -> its handle; PoolFull if no
        free region is large enough (a finishing sequence frees one)."""
        if tokens < 1:
            raise ValueError(f"a sequence needs at least one slot, got {tokens}")
        for i, (start, size) in enumerate(self._free):
            if size >= tokens:
                self._free[i:i + 1] = [(start + tokens, size - tokens)] if size > tokens else []
                handle, self._next = self._next, self._next + 1
                self._regions[handle] = Region(start, tokens)
                self.peak_slots = max(self.peak_slots, self.slots - self.free_slots)
                return handle
        raise PoolFull(f"no free cache region of {tokens} slots "
                       f"({self.free_slots} of {self.slots} slots free, fragmented)")

    def grow(self, seq: int, tokens: int) -> None:
        """Let the sequence cache up to `tokens` tokens: into the free slots right after its
        region, else in a new region its cached slots move to; PoolFull if neither fits."""
        r = self._regions[seq]
        if tokens <= r.size:
            return
        need, end = tokens - r.size, r.start + r.size
        for i, (start, size) in enumerate(self._free):
            if start == end and size >= need:
                self._free[i:i + 1] = [(start + need, size - need)] if size > need else []
                r.size = tokens
                self.peak_slots = max(self.peak_slots, self.slots - self.free_slots)
                return
        moved = self._regions.pop(self.allocate(tokens))  # PoolFull: nothing is changed
        at, to = slice(r.start, r.start + r.length), slice(moved.start, moved.start + r.length)
        self.k[:, :, to] = self.k[:, :, at]  # [L, Hkv, length, hd]
        self.v[:, :, to] = self.v[:, :, at]
        moved.length = r.length
        self._regions[seq] = moved
        self._free_span(r.start, r.size)

    def release(self, seq: int) -> None:
        region = self._regions.pop(seq)
        self._free_span(region.start, region.size)

    def _free_span(self, start: int, size: int) -> None:
        """Return slots to the free list, and their whole pages to the OS (RSS follows the
        KV in use, not its high-water mark)."""
        release_slots(self.k, start, start + size)  # [L, Hkv, S + 1, hd]
        release_slots(self.v, start, start + size)
        spans = sorted([*self._free, (start, size)])
        merged: list[tuple[int, int]] = []
        for start, size in spans:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        self._free = merged

    def region(self, seq: int) -> Region:
        return self._regions[seq]

    @property
    def free_slots(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def live(self) -> int:
        return len(self._regions)


# A member bringing at most this many new rows to a pass (decode and verify steps, not prompts)
# attends in plain float32 matmuls (`attend_rows`) instead of SDPA: on a CPU, SDPA's kernels
# cost ~0.4 ms a call for one query row over 286 keys in bf16 (0.07 ms in matmuls; 2.2 against
# 0.24 over 1300 keys), and a 32-member decode step makes 896 such calls (2-core EPYC, bf16
# target, 270-token contexts: 52% of a 771 ms step). Its rounding differs from SDPA's, so with
# row-invariant kernels (`invariant`) members attend through SDPA, as the one-sequence runtime.
SMALL_ATTENTION_ROWS = 64


class BatchTorchRuntime:
    """Our Transformer over a CachePool: `forward(batch)` runs one pass for every member.

    Built from a `TorchRuntime` (its weights, prepacked linears, RoPE tables and LM head are
    shared, not copied); its own one-sequence cache is left alone. `static`: run decode-sized
    passes in static shapes (forerun.runtime.batch_static), CUDA graphs on a GPU (default: as
    the one-sequence runtime does, which is on a GPU only; True on the CPU runs them eagerly,
    for tests)."""

    def __init__(self, runtime: TorchRuntime, budget_bytes: int, capacity: int | None = None,
                 static: bool | None = None):
        cfg = runtime.config
        self.config, self.single = cfg, runtime
        self.capacity = min(capacity or runtime.capacity, cfg.context_length)
        self.pool = CachePool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, budget_bytes,
                              runtime.dtype, runtime.device)
        self.cos, self.sin = runtime.cos, runtime.sin
        if self.cos.shape[0] < self.capacity:  # RoPE tables for every position a member uses
            self.cos, self.sin = rope_tables(cfg, self.capacity, runtime.dtype, runtime.device)
        static = runtime.capabilities.static_passes if static is None else static
        graphs = static and runtime.device.type == "cuda"
        self._static = BatchStaticPasses(self, graphs) if static else None
        self.capabilities = Capabilities(hidden_layers=True, final_hidden=True,
                                         static_passes=static, cuda_graphs=graphs, kv_copy=True,
                                         kv_grow=True, resume_rows=True)

    # --- sequences ------------------------------------------------------------------------

    def add(self, tokens: int) -> int:
        """A new sequence that will cache at most `tokens` tokens (PoolFull when none fits)."""
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context "
                             f"{self.capacity}")
        return self.pool.allocate(tokens)

    def release(self, seq: int) -> None:
        self.pool.release(seq)

    def grow(self, seq: int, tokens: int) -> None:
        """Let a member cache up to `tokens` tokens (PoolFull when the pool cannot)."""
        if tokens > self.capacity:
            raise ValueError(f"a sequence of {tokens} tokens exceeds the context "
                             f"{self.capacity}")
        self.pool.grow(seq, tokens)

    def length(self, seq: int) -> int:
        return self.pool.region(seq).length

    def reserved(self, seq: int) -> int:
        return self.pool.region(seq).size

    def commit(self, seq: int, base: int, rows: list[int]) -> None:
        """After a pass that appended a member's tokens at slot `base`: keep its rows `rows`
        (ascending indices into that member's tokens) as slots base.., drop the rest."""
        r = self.pool.region(seq)
        if rows and not (rows[0] >= 0 and base + rows[-1] < r.length):
            raise ValueError(f"rows {rows} are not in the last pass ({r.length - base} tokens)")
        if rows != list(range(len(rows))):  # a chain's prefix needs no move
            src = torch.tensor(rows, device=self.pool.k.device) + r.start + base  # [n]
            dst = slice(r.start + base, r.start + base + len(rows))
            self.pool.k[:, :, dst] = self.pool.k[:, :, src]  # [L, Hkv, n, hd]
            self.pool.v[:, :, dst] = self.pool.v[:, :, src]
        r.length = base + len(rows)

    def kv_bytes(self) -> int:
        return (self.pool.slots - self.pool.free_slots) * self.pool.bytes_per_token

    def kv_peak_bytes(self, reset: bool = False) -> int:
        peak = self.pool.peak_slots * self.pool.bytes_per_token
        if reset:
            self.pool.peak_slots = self.pool.slots - self.pool.free_slots
        return peak

    def truncate(self, seq: int, length: int) -> None:
        r = self.pool.region(seq)
        if not 0 <= length <= r.length:
            raise ValueError(f"cannot truncate a cache of {r.length} tokens to {length}")
        r.length = length

    def read_kv(self, seq: int, start: int, stop: int) -> KVCopy:
        """Copies of the member's cached keys and values of slots start..stop (a prefix cache
        keeps them)."""
        r = self.pool.region(seq)
        if not 0 <= start <= stop <= r.length:
            raise ValueError(f"slots {start}..{stop} are not cached ({r.length} are)")
        at = slice(r.start + start, r.start + stop)
        return KVCopy(self.pool.k[:, :, at].clone(), self.pool.v[:, :, at].clone())

    def write_kv(self, seq: int, blocks: list[KVCopy]) -> None:
        """Make the blocks, in order, the member's first cached slots (it caches them all)."""
        r = self.pool.region(seq)
        k = torch.cat([b.k for b in blocks], dim=2)  # [L, Hkv, n, hd]
        v = torch.cat([b.v for b in blocks], dim=2)
        n = k.shape[2]
        if n > r.size:
            raise ValueError(f"{n} slots do not fit a region of {r.size}")
        self.pool.k[:, :, r.start:r.start + n] = k
        self.pool.v[:, :, r.start:r.start + n] = v
        r.length = n

    # --- the pass -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """-> logits [R, V] for batch.logit_rows (all N rows when None), and the hidden
        states layer -> [N, D] of every row. A member's `batch.resume` rows enter at its
        layer from the states given (`forerun.runtime.batch_resume`); the others run all."""
        regions = [self.pool.region(s) for s in batch.seqs]
        starts = [r.length for r in regions]
        for b, r in enumerate(regions):
            n = batch.cu[b + 1] - batch.cu[b]
            if r.length + n > r.size:
                raise ValueError(f"sequence {batch.seqs[b]}: {r.length} + {n} tokens exceed "
                                 f"its {r.size} reserved slots")
        resumed = batch.resume is not None and any(r is not None for r in batch.resume)
        if not resumed and self._static is not None and self._static.fits(batch, hidden_layers):
            logits, h = self._static.forward(batch, starts)
            self._advance(batch, regions, starts)
            return ForwardOutput(logits, {-1: h} if -1 in hidden_layers else {})
        x, hidden = (resumed_layers(self, batch, regions, starts, hidden_layers) if resumed
                     else self._layers(batch, regions, starts, hidden_layers))
        self._advance(batch, regions, starts)
        model = self.single.model
        rows = x if batch.logit_rows is None else x[batch.logit_rows.to(x.device)]
        _, logits = self.single.head(rows)  # [R, V]
        if -1 in hidden_layers:  # the final normed state of every row, as the heads read it
            hidden[-1] = rms_norm(x, model.norm, self.config.norm_eps)
        return ForwardOutput(logits, hidden)  # on the device: the step syncs once

    def _layers(self, batch: PackedBatch, regions: list[Region], starts: list[int],
                hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Every block over every row -> the last block's output [N, D] and the hidden
        states layer -> [N, D] asked for."""
        device = self.pool.k.device
        positions = self._positions(batch, starts).to(device)  # [N]
        cos, sin = self.cos[positions], self.sin[positions]  # [N, hd]
        parts = [(r.start, starts[b], batch.cu[b + 1] - batch.cu[b],
                  self._mask(starts[b], batch.cu[b + 1] - batch.cu[b],
                             batch.tree_masks[b] if batch.tree_masks else None, device))
                 for b, r in enumerate(regions)]
        model = self.single.model
        x = model.embed(batch.tokens.to(device))  # [N, D]
        hidden = {}
        for i, layer in enumerate(model.layers):
            x = self._block(layer, i, x, cos, sin, parts)
            if i in hidden_layers:
                hidden[i] = x
        return x, hidden

    @torch.inference_mode()
    def lower(self, seq: int, tokens: torch.Tensor, start: int, layers: int) -> torch.Tensor:
        """Blocks 0..layers-1 over a member's tokens [T] at its slots start.. (their K/V
        written there, as a pass of this member alone would; its length is left as it is)
        -> the states entering block `layers` [T, D]: an early-exit draft's rows, which the
        verify pass then resumes (PackedBatch.resume)."""
        r, T = self.pool.region(seq), tokens.shape[0]
        if start + T > r.size:
            raise ValueError(f"sequence {seq}: {start} + {T} tokens exceed its {r.size} "
                             "reserved slots")
        device = self.pool.k.device
        at = torch.arange(start, start + T, device=device)  # [T]
        parts = [(r.start, start, T, self._mask(start, T, None, device))]
        cos, sin = self.cos[at], self.sin[at]  # [T, hd]
        x = self.single.model.embed(tokens.to(device))  # [T, D]
        for i, layer in enumerate(self.single.model.layers[:layers]):
            x = self._block(layer, i, x, cos, sin, parts)
        return x

    @staticmethod
    def _advance(batch: PackedBatch, regions: list[Region], starts: list[int]) -> None:
        """Every member's cache now holds its new tokens too."""
        for b, r in enumerate(regions):
            r.length = starts[b] + batch.cu[b + 1] - batch.cu[b]

    def _block(self, layer, i: int, x, cos, sin, parts: list[MemberRows]) -> torch.Tensor:
        """One decoder block over the packed rows x [N, D] of `parts`, in order: q/k/v, output
        and MLP matmuls over all rows at once; attention per member over its own region."""
        q, k, v = layer.qkv(x, cos, sin)  # [H, N, hd], [Hkv, N, hd], [Hkv, N, hd]
        kc, vc = self.pool.k[i], self.pool.v[i]  # [Hkv, S, hd]
        outs, at = [], 0
        for base, start, T, mask in parts:
            rows, s = slice(at, at + T), base + start
            kc[:, s:s + T], vc[:, s:s + T] = k[:, rows], v[:, rows]
            keys, values = self._member_kv(kc, vc, base, start, T)  # [Hkv, S_b, hd]
            small = T <= SMALL_ATTENTION_ROWS and not layer.invariant
            outs.append(attend_rows(q[:, rows], keys, values, mask) if small else
                        attend(q[:, rows], keys, values, mask, layer.invariant))  # [1,H,T,hd]
            at += T
        return layer.finish(x, torch.cat(outs, dim=2))  # [N, D]

    def _member_kv(self, kc: torch.Tensor, vc: torch.Tensor, base: int, start: int, T: int):
        """The keys and values [Hkv, S_b, hd] a member's T rows at `start` attend to, in its
        region at slot `base`: every slot up to and including them (a sparse view narrows it)."""
        return kc[:, base:base + start + T], vc[:, base:base + start + T]

    @staticmethod
    def _positions(batch: PackedBatch, starts: list[int]) -> torch.Tensor:
        offsets = torch.cat([torch.full((batch.cu[b + 1] - batch.cu[b],), starts[b])
                             for b in range(batch.size)])  # [N]
        if batch.positions is None:
            rel = torch.cat([torch.arange(batch.cu[b + 1] - batch.cu[b])
                             for b in range(batch.size)])
        else:
            rel = batch.positions
        return offsets + rel

    @staticmethod
    def _mask(start: int, T: int, tree_mask, device) -> torch.Tensor | None:
        """[T, start+T] bool: every cached slot of the member, then causal (or its tree)."""
        if T == 1 and tree_mask is None:
            return None
        new = tree_mask.bool() if tree_mask is not None else torch.ones(T, T, dtype=torch.bool
                                                                        ).tril()
        return torch.cat([torch.ones(T, start, dtype=torch.bool), new], dim=1).to(device)
