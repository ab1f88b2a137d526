"""Static-shape decode passes for the batched torch runtime, replayed as CUDA graphs on a GPU.

Owns: `BatchStaticPasses`, the decode-sized passes of a `BatchTorchRuntime` (every member a
few new tokens: a pending token and its draft) in a form whose shapes and addresses never
change, so that each padded size is captured once as a CUDA graph and replayed with one launch,
as `forerun.runtime.static` does for one sequence (whose `Recorded` sizes, `static_block` and
`launch` this reuses).

A pass of N rows runs at the smallest size B >= N of BATCH_SIZES, padded, attending over the
pool's first `span` slots (`span_of` the last slot any member reaches: first-fit keeps the live
regions low in the pool, so the span follows what is in use, not the budget):
- inputs go through one host buffer into a static device buffer, six numbers a row: token id,
  RoPE position, the cache slot the row writes, its member's region start and cache length
  (as slots: region start + length), and its mask among its member's new rows as a bitmask
  (bit j: it sees the member's j-th new row; causal for a chain, the tree's for a tree);
- the [B, span] mask is built on the device from those: a row sees its member's cached slots
  (region start .. start + length) and the new slots its bitmask names, nothing of another
  member;
- padded rows write their K/V into the pool's spare slot (past every region, never read) and
  see slot 0 only (no empty row); their logits are dropped;
- logits [B, V] and the final normed hidden state [B, D] land in static outputs; the wanted
  rows are copied out after the replay.
On the CPU (tests) the same pass runs eagerly, so its masks and padding are checked against the
eager batched forward without a GPU. Passes with more rows than the largest size, a member with
more than MAX_MEMBER_ROWS new tokens (a prompt), or hidden layers other than the final one take
the eager forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forerun.runtime.static import Recorded, span_of, static_block

if TYPE_CHECKING:
    from forerun.runtime.batch import BatchTorchRuntime, PackedBatch

BATCH_SIZES = (4, 8, 16, 32, 64, 128, 256)  # padded rows of a pass, each captured at first use
MAX_MEMBER_ROWS = 63  # a member's new rows: its mask row is one int64 bitmask (sign bit unused)
FIELDS = 6  # host numbers per row: token, position, slot, region start, cache end, mask bits


class BatchStaticPasses(Recorded):
    """The static decode passes of one batched runtime (its cache pool), per padded size and
    attention span; eager on the CPU, CUDA graphs (`graphs`) on a GPU."""

    def __init__(self, runtime: BatchTorchRuntime, graphs: bool):
        super().__init__(BATCH_SIZES, runtime.pool.slots, graphs)
        self.rt = runtime

    def fits(self, batch: PackedBatch, hidden_layers: tuple[int, ...] = ()) -> bool:
        widths = [batch.cu[b + 1] - batch.cu[b] for b in range(batch.size)]
        return (set(hidden_layers) <= {-1} and bool(self.sizes) and bool(widths)
                and 0 < len(batch.tokens) <= self.sizes[-1] and max(widths) <= MAX_MEMBER_ROWS)

    def _make(self, B: int, span: int) -> _BatchPass:
        return _BatchPass(self.rt, B, span)

    def forward(self, batch: PackedBatch, starts: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass over `batch`, member b's cache holding starts[b] tokens -> (logits [R, V]
        of batch.logit_rows (all N rows when None), final normed hidden [N, D]), on the
        device, copies (the static outputs are overwritten by the next pass)."""
        regions = [self.rt.pool.region(s) for s in batch.seqs]
        end = max(r.start + starts[b] + batch.cu[b + 1] - batch.cu[b]
                  for b, r in enumerate(regions))  # past the last slot any row writes
        N = len(batch.tokens)
        p = self._play(N, batch, [r.start for r in regions], starts,
                       span=span_of(end, self.rt.pool.slots))
        rows = batch.logit_rows
        logits = p.logits[:N].clone() if rows is None else p.logits[rows.to(p.logits.device)]
        return logits, p.hidden[:N].clone()


def _tree_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """tree_mask [T, T] bool -> [T] int64: bit j of row i set where new row i sees new row j."""
    weights = 1 << torch.arange(tree_mask.shape[0], dtype=torch.long)  # [T]; T <= 63
    return (tree_mask.to("cpu", torch.long) * weights).sum(-1)


class _BatchPass:
    """One padded size B over the pool's first `span` slots: static inputs and outputs, the
    pass over them, its graph."""

    def __init__(self, rt: BatchTorchRuntime, B: int, span: int):
        self.rt, self.B, self.span, self.graph = rt, B, span, None
        dev = rt.pool.k.device
        self.host = torch.zeros(FIELDS, B, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros_like(self.host, device=dev)  # [FIELDS, B]
        (self.tokens, self.positions, self.slots, self.lo, self.hi,
         self.bits) = self.inputs.unbind(0)  # each [B], views of one buffer
        self.columns = torch.arange(span, device=dev)  # [C]
        self.offsets = torch.arange(MAX_MEMBER_ROWS, device=dev)  # [M]
        cfg = rt.config
        self.logits = torch.zeros(B, cfg.vocab_size, dtype=rt.single.out_dtype, device=dev)
        self.hidden = torch.zeros(B, cfg.dim, dtype=rt.single.dtype, device=dev)  # [B, D]

    def load(self, batch: PackedBatch, region_starts: list[int], starts: list[int]) -> None:
        N, h = len(batch.tokens), self.host
        widths = torch.tensor(batch.cu[1:]) - torch.tensor(batch.cu[:-1])  # [members]
        member = torch.repeat_interleave(torch.arange(batch.size), widths)  # [N] each row's
        j = torch.arange(N) - torch.tensor(batch.cu[:-1])[member]  # [N] its index in its member
        length = torch.tensor(starts)[member]  # [N] its member's cache length
        lo = torch.tensor(region_starts)[member]  # [N] its member's region start
        h.zero_()
        h[2].fill_(self.rt.pool.slots)  # padding writes the spare slot ...
        h[4].fill_(1)  # ... and sees slot 0 alone (cache 0 .. 1, no mask bits)
        h[0, :N] = batch.tokens
        h[1, :N] = length + (j if batch.positions is None else batch.positions)
        h[2, :N] = lo + length + j
        h[3, :N], h[4, :N] = lo, lo + length
        h[5, :N] = ((1 << j) - 1) + (1 << j)  # causal: rows 0 .. j (no overflow at j = 62)
        for b, tree_mask in enumerate(batch.tree_masks or ()):
            if tree_mask is not None:
                h[5, batch.rows_of(b)] = _tree_bits(tree_mask)
        self.inputs.copy_(h, non_blocking=True)

    def mask(self) -> torch.Tensor:
        """[B, C] bool on the device: each row's member's cached slots and the new slots its
        bits name."""
        B, C = self.B, self.span
        cols = self.columns[None, :]  # [1, C]
        cached = (cols >= self.lo[:, None]) & (cols < self.hi[:, None])  # [B, C]
        seen = ((self.bits[:, None] >> self.offsets) & 1).bool()  # [B, M] new row j seen
        at = (self.hi[:, None] + self.offsets).clamp_max(C)  # [B, M]; past the span: column C
        new = torch.zeros(B, C + 1, dtype=torch.bool, device=cols.device)  # (only unseen rows
        new.scatter_(1, at, seen)  # land in C: a member's new slots all lie inside the span)
        return cached | new[:, :C]

    def run(self) -> None:
        """The pass over the static buffers (what the graph records)."""
        rt = self.rt
        model, pool = rt.single.model, rt.pool
        mask = self.mask()
        cos, sin = rt.cos[self.positions], rt.sin[self.positions]  # [B, hd]
        x = model.embed(self.tokens)  # [B, D]
        for i, layer in enumerate(model.layers):
            x = static_block(layer, x, cos, sin, pool.k[i], pool.v[i], self.slots, mask,
                             span=self.span)
        h, logits = rt.single.head(x)
        self.hidden.copy_(h)
        self.logits.copy_(logits)
