"""A sparse-KV view of a torch model for drafting (StreamingLLM's cache, as MagicDec drafts with).

Owns: a bounded KV cache over a `TorchRuntime`'s weights (its layers and LM head, never its
cache), in which every query at position p attends to the first `sinks` positions (attention
sinks) and the `window` most recent ones, p itself included: p - window < j <= p. So a pass
costs the same at any context length, and its memory is fixed.

Keys keep their original positions: each is rotated (RoPE) once, at the position it had in the
sequence, and never again, as MagicDec's drafts do (StreamingLLM instead renumbers the cache
0..size-1 so that no distance exceeds what the model was trained on). The contexts here lie
within the models' trained context, so the original distances are ones the model has seen; it
costs no re-rotation when the window slides; and with a window as long as the context the view
is the full model, to the bit (the tests check it).

Layout: cache slots 0..sinks-1 hold the sinks; slots sinks.. hold positions `evicted`,
`evicted` + 1, ... in order, so the slot of a position is arithmetic. Eviction is lazy: only when
a pass would not fit, positions older than the window and a rollback reserve (ROLLBACK) are
dropped by moving the rest down. A rollback (`truncate`) may go back ROLLBACK tokens past the
window's start of the latest pass; further back the window is gone and it raises, except to
the empty cache. A pass longer than PASS_ROWS (a prompt) runs in chunks.

Never samples, never tokenizes; a chain drafter's view: no trees, no positions of its own.
"""

from __future__ import annotations

import torch

from forerun.runtime.base import Capabilities, ForwardOutput, ModelConfig
from forerun.runtime.torch_model import TorchRuntime, rope_tables

PASS_ROWS = 256  # the most tokens one pass appends; a longer one (a prompt) runs in chunks
ROLLBACK = 64  # tokens a pass may be rolled back past its window's start (a draft's depth)


class StreamingRuntime:
    """One sequence over `base`'s weights, attending to `sinks` first + `window` recent tokens."""

    curve = None  # forerun.profile's calibration, at its first use
    capabilities = Capabilities(tree_masks=False)  # tokens in, logits out: a chain drafter

    def __init__(self, base: TorchRuntime, sinks: int, window: int, capacity: int | None = None,
                 pass_rows: int = PASS_ROWS, rollback: int = ROLLBACK):
        """`capacity`: the longest sequence (positions 0..capacity-1; default: base's);
        `pass_rows`, `rollback`: as PASS_ROWS and ROLLBACK (tests shrink them)."""
        if sinks < 0 or window < 1 or pass_rows < 1 or rollback < 0:
            raise ValueError(f"need sinks >= 0, window >= 1, pass_rows >= 1 and rollback >= 0, "
                             f"got {sinks}, {window}, {pass_rows} and {rollback}")
        self.base, self.sinks, self.window = base, sinks, window
        self.pass_rows, self.rollback = pass_rows, rollback
        self.config: ModelConfig = base.config
        self._capacity = min(capacity or base.capacity, base.config.context_length)
        self.slots = sinks + window + rollback + pass_rows  # the cache, fixed whatever the context
        cfg = self.config
        shape = (cfg.n_layers, cfg.n_kv_heads, self.slots, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=base.dtype, device=base.device)
        self.v_cache = torch.zeros(shape, dtype=base.dtype, device=base.device)
        # indexed by original position, as TorchRuntime's (same values, to the bit)
        self.cos, self.sin = rope_tables(cfg, self._capacity, base.dtype, base.device)
        self._length = 0  # tokens of the sequence appended (logical)
        self.evicted = sinks  # positions sinks..evicted-1 are gone; slot sinks holds `evicted`
        self.attended = 0  # (query, key) pairs attended, summed over passes: the cost counter
        self.last_mask: torch.Tensor | None = None  # [T, S] bool: the latest pass's attention

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def held(self) -> list[int]:
        """The positions whose keys and values the cache holds, in slot order."""
        return [*range(min(self._length, self.sinks)), *range(self.evicted, self._length)]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        if length <= self.sinks:  # nothing past the sinks is needed: start over there
            self.evicted = self.sinks
        elif max(self.sinks, length - self.window + 1) < self.evicted:
            raise ValueError(f"cannot roll back to {length}: positions before {self.evicted} "
                             f"are evicted and its window (the last {self.window}) needs them")
        self._length = length

    def keep(self, start: int, rows: list[int]) -> None:
        raise ValueError("the streaming view drafts chains: it keeps no tree rows")

    def fork(self) -> StreamingRuntime:
        """The same weights and view, an empty cache of its own."""
        return StreamingRuntime(self.base, self.sinks, self.window, self._capacity,
                                self.pass_rows, self.rollback)

    def _slot(self, position: int) -> int:
        return position if position < self.sinks else self.sinks + position - self.evicted

    def _make_room(self, rows: int) -> None:
        """Evict what no query from here on (nor after a rollback of `rollback`) can attend
        to, if the next `rows` would not fit: positions up to length - window - rollback."""
        if self._slot(self._length) + rows <= self.slots:
            return
        keep_from = max(self.evicted, self._length - self.window - self.rollback + 1)
        src, dst = self._slot(keep_from), self.sinks
        n = self._length - keep_from
        self.k_cache[:, :, dst:dst + n] = self.k_cache[:, :, src:src + n].clone()
        self.v_cache[:, :, dst:dst + n] = self.v_cache[:, :, src:src + n].clone()
        self.evicted = keep_from

    def mask(self, rows: int) -> torch.Tensor:
        """[rows, S] bool for `rows` new tokens over the held keys and theirs (slot order):
        query position p sees key position j iff j <= p and (j < sinks or j > p - window)."""
        start = self._length
        held = torch.tensor([*self.held(), *range(start, start + rows)])  # [S]
        query = torch.arange(start, start + rows).unsqueeze(1)  # [rows, 1]
        return (held <= query) & ((held < self.sinks) | (held > query - self.window))

    @torch.inference_mode()
    def forward(self, tokens, *, positions=None, tree_mask=None, last_only=False,
                hidden_layers=(), hidden_from=0) -> ForwardOutput:
        if positions is not None or tree_mask is not None or hidden_layers:
            raise ValueError("the streaming view runs chains of tokens only (no positions, "
                             "tree masks or hidden layers)")
        T = tokens.shape[0]
        if self._length + T > self._capacity:
            raise ValueError(f"context full: {self._length} + {T} tokens > capacity "
                             f"{self._capacity}")
        if T == 0:
            raise ValueError("a pass needs at least one token")
        # a prompt in chunks (under last_only, each chunk's last row alone: one spare LM-head row)
        step = self.pass_rows
        outs = [self._pass(tokens[at:at + step], last_only) for at in range(0, T, step)]
        return ForwardOutput(outs[-1] if last_only else torch.cat(outs))  # [1 or T, V]

    def _pass(self, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
        """One pass of at most `pass_rows` tokens -> logits [T or 1, V] on the CPU."""
        T = tokens.shape[0]
        self._make_room(T)
        start, first = self._length, self._slot(self._length)
        mask = self.mask(T).to(self.base.device)  # [T, first + T]
        self.attended += int(mask.sum())
        self.last_mask = mask
        # one row that sees every key is what the full cache runs (no mask): the same bits
        attn_mask = None if T == 1 and bool(mask.all()) else mask
        positions = torch.arange(start, start + T, device=self.base.device)
        cos, sin = self.cos[positions], self.sin[positions]  # [T, hd]
        x = self.base.model.embed(tokens.to(self.base.device))  # [T, D]
        for i, layer in enumerate(self.base.model.layers):
            x = layer(x, cos, sin, self.k_cache[i], self.v_cache[i], first, attn_mask)
        self._length = start + T
        _, logits = self.base.head(x[-1:] if last_only else x)  # [T or 1, V]
        return logits.cpu()
