"""The early-exit draft (LayerSkip, Elhoushi et al. 2024): the target's first E layers and an
exit head, run as a Runtime.

Owns: `ExitAdapter`, a residual linear map on the layer-E hidden state (zero = the identity;
`forerun train early-exit` fits it, since our checkpoints were not trained to exit early), and
`ExitDraft`, the draft runtime. The draft runs the target's own blocks 0..E-1 (shared, never
copied) and exits through the adapter, the target's final norm and its LM head.

`shared`: the draft's cache is the first E layers of the target's own cache: views of the
same storage for a sequence decoded alone, or (`pool`, a batch member) the member's own region
of the batch's cache pool, written through `BatchTorchRuntime.lower` at layers 0..E-1 (bound
to the member's handle at each admission: `bind`). The K/V it writes for a drafted token at
its slot are the target's own, since weights, token and position are the same; it keeps the
layer-E states of the rows it ran (`resume`), and the verify pass starts those rows at layer E
(`forerun.runtime.base.Resume`, `PackedBatch.resume`), computing layers E.. only. A rejected
token's slots are overwritten by a later pass, as any rejected slot. Not shared (a batch whose
runtime cannot resume rows): a cache of its own over E layers (the prompt fed through them
too), and the verify computes every layer. Chains only: each token is appended at the next
slot. Before its first admission a pool-mode draft has no region (the cost policy times
the draft as the member's policy is built): it runs over a small cache of its own then
(`UNBOUND_SLOTS`), the same blocks at the same cost per token.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forerun.runtime.base import Capabilities, ForwardOutput, Resume
from forerun.runtime.memory import lazy_zeros
from forerun.runtime.torch_model import PackedLinear, TorchRuntime, rms_norm

if TYPE_CHECKING:
    from forerun.runtime.batch import BatchTorchRuntime

UNBOUND_SLOTS = 1024  # an unadmitted pool-mode draft's own cache (a timing's context + passes)


class ExitAdapter(nn.Module):
    """h -> h + W h on the layer-E hidden state [T, D], before the final norm; W = 0 is the
    identity (the untrained exit head: the target's norm and LM head alone). `vocab`: the
    tokens the exit head scores (FR-Spec: the LM head is ~5 of Qwen2.5-1.5B's 28 layers'
    weights; a draft that cannot propose a rare token stays lossless); None = every token."""

    def __init__(self, dim: int, vocab: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dim))  # [D, D]
        self.vocab = vocab  # [N] sorted token ids, or None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.linear(h, self.weight.to(h.dtype))


class ExitDraft:
    """The first `layers` blocks of `target` plus its exit head, over the target's cache
    (`shared`: its own, or a batch member's region of `pool`) or one of its own (`capacity`
    slots)."""

    def __init__(self, target: TorchRuntime, layers: int, adapter: ExitAdapter | None = None,
                 shared: bool = True, capacity: int | None = None,
                 pool: BatchTorchRuntime | None = None):
        cfg = target.config
        if not 0 < layers < cfg.n_layers:
            raise ValueError(f"early exit: the exit layer must lie in 1..{cfg.n_layers - 1} "
                             f"(of {cfg.n_layers} layers), got {layers}")
        self.target, self.layer, self.shared, self.adapter = target, layers, shared, adapter
        self.pool = pool if shared else None
        self.seq = -1  # the member's region of `pool` (`bind`); -1 = not admitted
        self._unbound: ExitDraft | None = None  # `pool` before admission: a cache of its own
        self.blocks = target.model.layers[:layers]
        self.config = replace(cfg, n_layers=layers)
        self.capabilities = Capabilities()
        self.curve = None  # forerun.profile's, at its first use (the cost policy's draft cost)
        if self.pool is not None:  # the member's region, looked up at each pass (it may move)
            self.k_cache = self.v_cache = None
            self._capacity = 0
        elif shared:  # views: what the draft writes is the target's cache at layers 0..E-1
            self.k_cache, self.v_cache = target.k_cache[:layers], target.v_cache[:layers]
            self._capacity = target.capacity
        else:
            self._capacity = min(capacity or target.capacity, target.capacity)
            shape = (layers, cfg.n_kv_heads, self._capacity, cfg.head_dim)
            self.k_cache = lazy_zeros(shape, target.dtype, target.device)
            self.v_cache = lazy_zeros(shape, target.dtype, target.device)
        self._length = 0
        self._exit = exit_map(adapter, target)
        self._vocab = None if adapter is None else adapter.vocab  # [N] or None: every token
        if self._vocab is not None:  # the kept rows of the LM head, copied for the draft alone
            weight = target.model.lm_weight().detach()[self._vocab.to(target.device)]  # [N, D]
            self._head = (PackedLinear(weight.contiguous()) if target.prepacked else
                          (lambda h, w=weight: F.linear(h, w)))
        self._kept: list[torch.Tensor] = []  # [T_i, D] layer-E states since `align` (shared)

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        if self.pool is None:
            return self._capacity
        return self.pool.reserved(self.seq) if self.seq >= 0 else self._alone().capacity

    def _alone(self) -> ExitDraft:
        """What a pool-mode draft runs on before its first admission: the same blocks over
        a small cache of its own (UNBOUND_SLOTS)."""
        if self._unbound is None:
            self._unbound = ExitDraft(self.target, self.layer, self.adapter, shared=False,
                                      capacity=UNBOUND_SLOTS)
        return self._unbound

    @property
    def target_length(self) -> int:
        """Tokens in the cache the draft shares (the target's, or the member's region)."""
        return self.target.length if self.pool is None else self.pool.length(self.seq)

    def bind(self, seq: int) -> None:
        """`pool`: the member's region is `seq` now (at each admission; a preempted member
        comes back in another). Alone there is nothing to bind: the target's cache is one."""
        if self.pool is None:
            return
        self.seq, self._length, self._kept, self._unbound = seq, 0, [], None

    def truncate(self, length: int) -> None:
        if self.pool is not None and self.seq < 0:
            return self._alone().truncate(length)
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        self._length = length

    def align(self, length: int) -> None:
        """Shared: the target's cache holds `length` tokens, so the draft's layers do too;
        drafting continues at that slot, and the states kept for `resume` start there."""
        if not self.shared or length > self.target_length:
            raise ValueError("align: a shared draft takes the length of its target's cache")
        self._length, self._kept = length, []

    def resume(self) -> Resume:
        """The layer-E states of the rows run since `align` (slots align.. in order), for
        the verify pass that starts them at layer E."""
        return Resume(self.layer, torch.cat(self._kept))  # [m, D]

    @torch.inference_mode()
    def forward(self, tokens, *, positions=None, tree_mask=None, last_only=False,
                hidden_layers=(), hidden_from=0) -> ForwardOutput:
        if positions is not None or tree_mask is not None or hidden_layers:
            raise ValueError("the early-exit draft runs chains and returns no hidden layers")
        if self.pool is not None and self.seq < 0:  # not admitted yet (the policy's timing)
            return self._alone().forward(tokens, last_only=last_only)
        start, T, t = self._length, tokens.shape[0], self.target
        if self.pool is not None:  # the member's region: the batch's blocks, as its passes
            x = self.pool.lower(self.seq, tokens, start, self.layer)  # [T, D]
            self._kept.append(x)
            self._length = start + T
            return ForwardOutput(self.exit_head(x[-1:] if last_only else x).cpu())
        if start + T > self._capacity:
            raise ValueError(f"context full: {start} + {T} tokens > capacity {self._capacity}")
        at = torch.arange(start, start + T, device=t.device)
        cos, sin = t.cos[at], t.sin[at]  # [T, hd]
        mask = None if T == 1 else torch.cat(  # [T, start+T]: every cached slot, then causal
            [torch.ones(T, start, dtype=torch.bool), torch.ones(T, T, dtype=torch.bool).tril()],
            dim=1).to(t.device)
        x = t.model.embed(tokens.to(t.device))  # [T, D]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, self.k_cache[i], self.v_cache[i], start, mask)
        if self.shared:
            self._kept.append(x)
        self._length = start + T
        return ForwardOutput(self.exit_head(x[-1:] if last_only else x).cpu())

    def exit_head(self, x: torch.Tensor) -> torch.Tensor:
        """Layer-E states [T, D] -> the exit head's logits [T, V] (-inf outside its vocab)."""
        h = self._exit(x)
        if self._vocab is None:
            return self.target.head(h)[1]
        normed = rms_norm(h, self.target.model.norm, self.config.norm_eps)
        kept = self._head(normed).to(self.target.out_dtype)  # [T, N]
        logits = kept.new_full((kept.shape[0], self.config.vocab_size), float("-inf"))
        return logits.index_copy_(1, self._vocab.to(kept.device), kept)  # [T, V]

    def keep(self, start: int, rows: list[int]) -> None:
        raise ValueError("the early-exit draft drafts chains: it never keeps a tree's path")

    def fork(self) -> ExitDraft:
        raise ValueError("the early-exit draft is built per sequence, not forked")


def exit_map(adapter: ExitAdapter | None, target: TorchRuntime):
    """The adapter as the draft runs it: none (or W = 0) is the identity; else h + W h in the
    target's dtype, prepacked where the target's linears are."""
    if adapter is None or not adapter.weight.any():
        return lambda h: h
    weight = adapter.weight.detach().to(target.dtype, copy=True)  # [D, D]
    linear = PackedLinear(weight) if target.prepacked else (lambda h: F.linear(h, weight))
    return lambda h: h + linear(h)
