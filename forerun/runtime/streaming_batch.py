"""The sparse-KV view of a batched torch model: every member's attention covers only its first
`sinks` positions and its `window` most recent ones (StreamingLLM's pattern, as MagicDec drafts
with), over the cache pool of a `BatchTorchRuntime` it shares.

Owns: which of a member's cached keys a pass reads, and the banded mask over them. A query at
position p attends to key j iff j <= p and (j < sinks or j > p - window), p itself included,
as `forerun.runtime.streaming.StreamingRuntime`'s one-sequence view. A pass over a member's T
new rows at positions start..start+T-1 reads the sinks and the slots from start - window + 1
on: sinks + window + T - 1 keys at most, whatever the context (a decode row: sinks + window),
so a draft row's attention costs the same at 2k or 16k tokens (`attended` counts the pairs).
A longer pass (a prompt's catch-up) reads the same band under the banded mask.

Keys keep their original positions (rotated once, where they were written), so with a window
as long as the context the view is the dense runtime to the bit (same keys, same masks, same
kernels; the tests check it).

Memory is the dense pool's: a member's region holds every position, as the full-cache draft's
does (eviction would bound it; here only the cost is bounded), so rollback is setting the
length, and the dense runtime and this view may hold members side by side in the same pool (a
batch mixing `draft` and `magicdec` members reserves one draft pool). The pool may be the
target's own (magicdec's `self` drafter, `forerun.propose.magicdec.SelfDraft`): the view then
writes draft rows past a member's committed tokens, which its verify overwrites. Chains only:
no trees, no hidden states; static (CUDA-graph) passes are the dense runtime's alone.
"""

from __future__ import annotations

import torch

from forerun.runtime.base import Capabilities, ForwardOutput
from forerun.runtime.batch import BatchTorchRuntime, PackedBatch


class StreamingBatchRuntime(BatchTorchRuntime):
    """`dense`'s weights and cache pool, each member attending to sinks + a recent window."""

    def __init__(self, dense: BatchTorchRuntime, sinks: int, window: int):
        if sinks < 0 or window < 1:
            raise ValueError(f"need sinks >= 0 and window >= 1, got {sinks} and {window}")
        self.sinks, self.window = sinks, window
        self.config, self.single, self.capacity = dense.config, dense.single, dense.capacity
        self.pool, self.cos, self.sin = dense.pool, dense.cos, dense.sin  # shared, not copied
        self._static = None  # every pass eager: static passes attend to the whole region
        self.capabilities = Capabilities(tree_masks=False, kv_copy=True, kv_grow=True)
        self.attended = 0  # (query, key) pairs attended, summed over passes: the cost counter
        self.last_keys: list[list[int]] = []  # per member of the latest pass: positions read
        self.last_masks: list[torch.Tensor] = []  # and its [T_b, S_b] bool mask over them

    def band(self, start: int, rows: int) -> list[int]:
        """The positions a pass of `rows` new tokens at `start` reads, ascending: the sinks
        and every position from start - window + 1 on (theirs included)."""
        first = start - self.window + 1  # the earliest position the first row's window holds
        if first <= self.sinks:  # the sinks and the window touch: one span
            return list(range(start + rows))
        return [*range(self.sinks), *range(first, start + rows)]

    def band_mask(self, start: int, rows: int) -> torch.Tensor:
        """[rows, S] bool over `band(start, rows)`: query p sees j iff j <= p and (j < sinks or
        j > p - window)."""
        held = torch.tensor(self.band(start, rows))  # [S]
        query = torch.arange(start, start + rows).unsqueeze(1)  # [rows, 1]
        return (held <= query) & ((held < self.sinks) | (held > query - self.window))

    @torch.inference_mode()
    def forward(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        if hidden_layers or batch.positions is not None or (
                batch.tree_masks is not None and any(m is not None for m in batch.tree_masks)):
            raise ValueError("the streaming view runs chains of tokens only (no trees, "
                             "positions or hidden layers)")
        regions = [self.pool.region(s) for s in batch.seqs]
        self.last_keys = [self.band(r.length, batch.cu[b + 1] - batch.cu[b])
                          for b, r in enumerate(regions)]
        self.last_masks = [self.band_mask(r.length, batch.cu[b + 1] - batch.cu[b])
                           for b, r in enumerate(regions)]
        self.attended += sum(int(m.sum()) for m in self.last_masks)
        return super().forward(batch)

    def _mask(self, start: int, T: int, tree_mask, device) -> torch.Tensor | None:
        """[T, S] bool over the band's keys; None for one row that sees all of them (what the
        dense runtime runs: the same bits)."""
        mask = self.band_mask(start, T)
        return None if T == 1 and bool(mask.all()) else mask.to(device)

    def _member_kv(self, kc: torch.Tensor, vc: torch.Tensor, base: int, start: int, T: int):
        """The keys and values [Hkv, S_b, hd] of `band(start, T)` in a region at slot `base`:
        views when one span, else the sinks and the window joined (a copy of S_b slots)."""
        first = start - self.window + 1
        end = base + start + T
        if first <= self.sinks:
            return kc[:, base:end], vc[:, base:end]
        sinks, recent = slice(base, base + self.sinks), slice(base + first, end)
        return (torch.cat([kc[:, sinks], kc[:, recent]], dim=1),
                torch.cat([vc[:, sinks], vc[:, recent]], dim=1))
