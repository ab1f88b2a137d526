"""A batched pass whose members' first rows resume at a layer: early exit's KV reuse in a batch.

Owns: `resumed_layers`, the blocks of a `BatchTorchRuntime` pass in which member b's first m_b
rows (`PackedBatch.resume[b]`: the pending token and all but the last drafted token of an
early-exit draft) enter at layer E_b from the states its draft computed. The draft ran blocks
0..E_b-1 for those rows over the member's own pool region (`BatchTorchRuntime.lower`), so their
keys and values there are already the target's: the same weights, tokens and positions. Below
E_b the pass runs every other row only (the member's later rows attend to the cached lower K/V
of the skipped ones); at E_b the skipped rows join, and from there on every row of the pass
runs together, as in a plain pass.

    layer   0 .. E-1            E .. L-1
    rows    other members,      every row
            last draft row

Invariants: a resumed member is a chain (no tree, no positions); a hidden layer below some
member's E is refused (those rows have none); rows are the pass's, in order, from layer
max(E) on, so logits and hidden states read as a plain pass's. Never samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forerun.runtime.base import Resume

if TYPE_CHECKING:
    from forerun.runtime.batch import BatchTorchRuntime, PackedBatch, Region


def resumed_layers(rt: BatchTorchRuntime, batch: PackedBatch, regions: list[Region],
                   starts: list[int], hidden_layers: tuple[int, ...]
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every block of `rt`'s model over the pass, each member's resumed rows from its layer
    on -> the last block's output [N, D] and the hidden states layer -> [N, D] asked for."""
    resumes = batch.resume or (None,) * batch.size
    sizes = [batch.cu[b + 1] - batch.cu[b] for b in range(batch.size)]  # [B] T_b
    _check(batch, resumes, sizes, hidden_layers, rt.config.n_layers)
    skipped = [0 if r is None else r.rows for r in resumes]  # [B] m_b
    entry = [0 if r is None else r.layer for r in resumes]  # [B] E_b
    device = rt.pool.k.device
    positions = rt._positions(batch, starts).to(device)  # [N]
    masks = [rt._mask(starts[b], sizes[b], batch.tree_masks[b] if batch.tree_masks else None,
                      device) for b in range(batch.size)]  # the full rows' (a plain pass's)
    model = rt.single.model
    off = list(skipped)  # [B] each member's first rows not run at this layer
    x = model.embed(batch.tokens[_active(batch, off)].to(device))  # [n, D]
    hidden = {}
    for i, layer in enumerate(model.layers):
        now = [m if i < e else 0 for m, e in zip(skipped, entry, strict=True)]
        if now != off:  # some members' resumed rows join here
            x = _splice(x, sizes, off, now, resumes)
            off = now
        at = _active(batch, off).to(device)  # [n] the pass's rows this block runs
        parts = [(regions[b].start, starts[b] + off[b], sizes[b] - off[b],
                  masks[b] if not off[b] else
                  rt._mask(starts[b] + off[b], sizes[b] - off[b], None, device))
                 for b in range(batch.size) if sizes[b] > off[b]]
        if parts:
            x = rt._block(layer, i, x, rt.cos[positions[at]], rt.sin[positions[at]], parts)
        if i in hidden_layers:
            hidden[i] = x
    return x, hidden


def _check(batch: PackedBatch, resumes, sizes: list[int], hidden_layers: tuple[int, ...],
           n_layers: int) -> None:
    top = max(r.layer for r in resumes if r is not None)
    for b, r in enumerate(resumes):
        if r is None:
            continue
        tree = batch.positions is not None or (
            batch.tree_masks is not None and batch.tree_masks[b] is not None)
        if tree or not 0 < r.layer < n_layers or not 0 < r.rows <= sizes[b]:
            raise ValueError(f"resume: member {b}'s chain of {sizes[b]} rows resumes 1..{sizes[b]}"
                             f" rows at a layer in 1..{n_layers - 1}; got {r.rows} rows at "
                             f"layer {r.layer}{' of a tree' if tree else ''}")
    if any(0 <= i < top for i in hidden_layers):
        raise ValueError(f"resume: resumed rows have no hidden state below layer {top}; "
                         f"asked for layers {list(hidden_layers)}")


def _active(batch: PackedBatch, off: list[int]) -> torch.Tensor:
    """[n] the pass's rows past each member's first off[b]: the rows a block runs."""
    return torch.cat([torch.arange(batch.cu[b] + off[b], batch.cu[b + 1])
                      for b in range(batch.size)])


def _splice(x: torch.Tensor, sizes: list[int], off: list[int], now: list[int],
            resumes: tuple[Resume | None, ...]) -> torch.Tensor:
    """The rows x [n, D] (member b's last sizes[b] - off[b]) with each member's resumed rows
    now[b]..off[b]-1 put back before its own -> [n', D]."""
    chunks, at = [], 0
    for b, size in enumerate(sizes):
        own = x[at:at + size - off[b]]  # [T_b - off_b, D]
        at += size - off[b]
        resume = resumes[b]
        if now[b] < off[b] and resume is not None:
            chunks.append(resume.hidden[now[b]:off[b]].to(device=x.device, dtype=x.dtype))
        chunks.append(own)
    return torch.cat(chunks)  # [n', D]
