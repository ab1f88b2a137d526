"""A compact Llama-family transformer (Llama, SmolLM2, Qwen2) with a static KV cache, in PyTorch.

Owns: the network (RMSNorm, RoPE, GQA attention with optional qkv bias, SwiGLU, tied or separate
LM head), the position-indexed KV cache, and `TorchRuntime`, the Runtime over both.
Weights arrive as a dict of canonical names (see `CANONICAL_NAMES`) from `forerun.models.load`;
q/k/v and gate/up are fused here into one matmul each, which is what the CPU likes.

Invariants: the cache is allocated once (`capacity` slots); cache slot i holds the token appended
i-th, so rollback is setting `length`; attention of a new token sees every cached slot before the
new block plus the new tokens its mask allows (causal for chains, explicit for trees).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from forerun.runtime.base import Capabilities, ForwardOutput, ModelConfig, Resume
from forerun.runtime.memory import lazy_zeros
from forerun.runtime.static import StaticPasses

# Canonical parameter names a loader must provide; "{i}" is the layer index.
CANONICAL_NAMES = (
    "embed", "norm", "lm_head",
    "layers.{i}.attn_norm", "layers.{i}.wq", "layers.{i}.wk", "layers.{i}.wv",
    "layers.{i}.bq", "layers.{i}.bk", "layers.{i}.bv", "layers.{i}.wo",
    "layers.{i}.ffn_norm", "layers.{i}.w_gate", "layers.{i}.w_up", "layers.{i}.w_down",
)


LOW_PRECISION = (torch.bfloat16, torch.float16)
# Row-invariant kernels on the CPU (oneDNN): a prepacked linear computes each row of a pass of
# 2 or more rows to the same bits whatever the other rows, but takes another kernel for one row;
# SDPA's math kernel gives each query row the same bits from 4 rows on. So with `invariant`, a
# one-row matmul runs as two rows and fewer than 4 query rows are padded to 4: a token's logits
# are then the same in a one-token decode step, a verify pass of k+1 and a batch of sequences.
MIN_MATMUL_ROWS = 2
MIN_ATTENTION_ROWS = 4
REFINE_TOP = 8  # candidates whose logits are recomputed in float32


def refine_top_logits(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 logits keep 8 bits of mantissa: near 18 they are multiples of 0.125, so the top
    two often tie exactly and the argmax then depends on which kernel (1-token or k-token pass)
    rounded last. Recompute the top candidates' logits in float32 from the same hidden state."""
    top = logits.topk(min(REFINE_TOP, logits.shape[-1]), dim=-1).indices  # [T, m]
    exact = torch.einsum("td,tmd->tm", x.float(), weight[top].float())  # [T, m]
    return logits.float().scatter_(-1, top, exact)  # [T, V] float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float() if x.dtype != torch.float64 else x
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return out.to(x.dtype) * weight


def rope_tables(cfg: ModelConfig, length: int, dtype: torch.dtype, device) -> tuple:
    """cos/sin tables [length, head_dim] for the rotate-half (NeoX / HF) layout."""
    compute = torch.float64
    inv_freq = 1.0 / (cfg.rope_theta ** (
        torch.arange(0, cfg.head_dim, 2, dtype=compute, device=device) / cfg.head_dim))
    angles = torch.outer(torch.arange(length, dtype=compute, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # [length, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [H, T, hd]; cos, sin: [T, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN has reordered once into its blocked layout.

    On CPUs, `F.linear` re-reads a row-major weight on every call and falls back to slow kernels
    for 2-16 rows; the prepacked path runs 1-token decoding about 2x faster in float32 and keeps
    the cost of verifying a few tokens close to the cost of one (see `forerun bench
    curve`). Same math, same dtype; only the summation order may differ."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()
        self.invariant = False  # pad one row to MIN_MATMUL_ROWS (see above)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant and x.shape[0] < MIN_MATMUL_ROWS:
            pad = x[-1:].expand(MIN_MATMUL_ROWS - x.shape[0], -1)
            return self._linear(torch.cat([x, pad]))[: x.shape[0]]
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def dense_weight(self) -> torch.Tensor:
        """The weight [O, I] back in its row-major layout (exactly: the reorder is lossless)."""
        return self.packed.to_dense()


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packs float32 on any CPU, bfloat16 only where it has bf16 kernels (AVX512-BW/VL/DQ
    or AVX-NE-CONVERT: an AVX2-only CPU raises on the reorder, so it keeps nn.Linear)."""
    if not (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def prepack_linears(model: nn.Module) -> None:
    """Swap every nn.Linear under `model` for a PackedLinear (CPU float32/bfloat16 only)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias))
        else:
            prepack_linears(child)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor | None, invariant: bool = False) -> torch.Tensor:
    """Attention of q [H, T, hd] over keys, values [Hkv, S, hd] (GQA) -> [1, H, T, hd]; mask
    [T, S] bool or None. `invariant`: fewer than MIN_ATTENTION_ROWS query rows are padded
    (copies of the last row, with its mask row), so each row's result is the same at any T."""
    T = q.shape[1]
    if invariant and T < MIN_ATTENTION_ROWS:
        pad = MIN_ATTENTION_ROWS - T
        q = torch.cat([q, q[:, -1:].expand(-1, pad, -1)], dim=1)
        if mask is None:  # one row attends to every key
            mask = torch.ones(MIN_ATTENTION_ROWS, keys.shape[1], dtype=torch.bool,
                              device=q.device)
        else:
            mask = torch.cat([mask, mask[-1:].expand(pad, -1)])
    out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                         attn_mask=mask, enable_gqa=True)  # [1, H, T', hd]
    return out[:, :, :T]


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
    """`attend` for a few query rows, in plain float32 (float64) matmuls: softmax(q k^T /
    sqrt(hd)) v, the query heads that share a KV head side by side (GQA without copying the
    keys). q [H, T, hd], keys and values [Hkv, S, hd], mask [T, S] bool or None -> [1, H, T,
    hd]. On a CPU it is several times faster than SDPA for one to a few rows (see
    `forerun.runtime.batch.SMALL_ATTENTION_ROWS`)."""
    H, T, hd = q.shape
    hkv = keys.shape[0]
    g = H // hkv  # query heads per KV head: head h reads KV head h // g, as enable_gqa
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc).reshape(hkv, g * T, hd) @ keys.to(acc).transpose(-1, -2)) * hd ** -0.5
    if mask is not None:  # [Hkv, g*T, S]
        scores = scores.view(hkv, g, T, -1).masked_fill(~mask, -math.inf).view(hkv, g * T, -1)
    out = scores.softmax(-1) @ values.to(acc)  # [Hkv, g*T, hd]
    return out.view(1, H, T, hd).to(q.dtype)


# a sequence's share of a multi-sequence block pass: (k cache, v cache [Hkv, capacity, hd],
# its first new slot, its row count T, its mask [T, start+T] bool or None)
CacheRows = tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.invariant = False  # row-invariant attention (see MIN_ATTENTION_ROWS)
        hd = cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * hd, cfg.n_kv_heads * hd
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.wqkv = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.q_size, cfg.dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, k_cache, v_cache, start: int, mask):
        # x: [T, D]; k_cache, v_cache: [Hkv, capacity, hd]; mask: [T, start+T] bool or None
        return self.forward_parts(x, cos, sin, [(k_cache, v_cache, start, x.shape[0], mask)])

    def forward_parts(self, x, cos, sin, parts: list[CacheRows]):
        """The block over the rows x [R, D] of several sequences: part (k_cache, v_cache,
        start, T, mask) owns the next T rows, written to its cache's slots start.. and
        attending to that cache alone (mask [T, start+T] or None); the linears run once over
        all R rows. A batch's drafting heads (EAGLE) step every member in one call."""
        q, k, v = self.qkv(x, cos, sin)  # [H, R, hd], [Hkv, R, hd], [Hkv, R, hd]
        outs, r = [], 0
        for k_cache, v_cache, start, T, mask in parts:
            k_cache[:, start:start + T] = k[:, r:r + T]
            v_cache[:, start:start + T] = v[:, r:r + T]
            keys, values = k_cache[:, :start + T], v_cache[:, :start + T]  # [Hkv, S, hd]
            outs.append(attend(q[:, r:r + T], keys, values, mask, self.invariant))
            r += T
        return self.finish(x, outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))

    def qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [H, T, hd], k [Hkv, T, hd] (both rotated), v [Hkv, T, hd]."""
        cfg, T = self.cfg, x.shape[0]
        qkv = self.wqkv(rms_norm(x, self.attn_norm, cfg.norm_eps))  # [T, (H+2Hkv)*hd]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(T, cfg.n_heads, -1).transpose(0, 1), cos, sin)  # [H, T, hd]
        k = apply_rope(k.view(T, cfg.n_kv_heads, -1).transpose(0, 1), cos, sin)  # [Hkv, T, hd]
        return q, k, v.view(T, cfg.n_kv_heads, -1).transpose(0, 1)

    def finish(self, x, attn) -> torch.Tensor:
        """x [T, D] and its attention output [1, H, T, hd] -> the block's output [T, D]."""
        x = x + self.wo(attn[0].transpose(0, 1).reshape(x.shape[0], self.q_size))
        gate, up = self.w_gate_up(rms_norm(x, self.ffn_norm, self.cfg.norm_eps)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.lm_head = None if cfg.tied_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, False)

    def lm_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def without_layers(self, skip: Collection[int]) -> Transformer:
        """This model with the layers `skip` left out: the same modules and parameters
        (shared, never copied), the kept layers in their order."""
        twin = Transformer.__new__(Transformer)
        nn.Module.__init__(twin)
        kept = [layer for i, layer in enumerate(self.layers) if i not in skip]
        twin.cfg = replace(self.cfg, n_layers=len(kept))
        twin.embed, twin.norm, twin.lm_head = self.embed, self.norm, self.lm_head
        twin.layers = nn.ModuleList(kept)
        return twin

    @torch.no_grad()
    def load_canonical(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy canonical (unfused) weights in, fusing q/k/v and gate/up."""
        self.embed.weight.copy_(weights["embed"])
        self.norm.copy_(weights["norm"])
        if self.lm_head is not None:
            self.lm_head.weight.copy_(weights["lm_head"])
        for i, layer in enumerate(self.layers):
            w = {name.split(".")[-1]: t for name, t in weights.items()
                 if name.startswith(f"layers.{i}.")}
            layer.attn_norm.copy_(w["attn_norm"])
            layer.wqkv.weight.copy_(torch.cat([w["wq"], w["wk"], w["wv"]]))
            if layer.wqkv.bias is not None:
                layer.wqkv.bias.copy_(torch.cat([w["bq"], w["bk"], w["bv"]]))
            layer.wo.weight.copy_(w["wo"])
            layer.ffn_norm.copy_(w["ffn_norm"])
            layer.w_gate_up.weight.copy_(torch.cat([w["w_gate"], w["w_up"]]))
            layer.w_down.weight.copy_(w["w_down"])


class TorchRuntime:
    """Runtime over our Transformer: one sequence, a static KV cache of `capacity` slots."""

    def __init__(self, model: Transformer, capacity: int, prepack: bool | None = None,
                 static: bool | None = None, spans: bool = False,
                 invariant: bool = False, source: Path | None = None,
                 head: nn.Module | None = None):
        """`prepack`: reorder the weights for oneDNN (default: where it applies, CPU float32 and
        bfloat16); the model is changed in place. `static`: run decode-sized passes in static
        shapes (forerun.runtime.static), replayed as CUDA graphs on a GPU (default: on a GPU
        only; True on the CPU runs them eagerly, for tests). `spans` (experimental, off: not
        yet timed on a GPU): static passes attend over a power-of-two span of the cache
        instead of all of it (see forerun.runtime.static.span_of). `invariant`: row-invariant
        kernels (MIN_MATMUL_ROWS, MIN_ATTENTION_ROWS), so a token's logits do not depend on
        how many rows share its pass, op by op (off by default: on the real default target it
        did not make bfloat16 speculation equal plain decoding; docs/runtimes.md); set on the
        model, so its forks and batched views share it. `source`: the weights' file (what
        settings tuned for them are keyed by: layer-skip's set), None for a model built here.
        `head`: the LM head as a module of its own (a quantized draft's, forerun.runtime.
        quantized), whose logits are not refined; None = the model's LM weight."""
        cfg = model.cfg
        self.config, self.model, self.source = cfg, model, source
        param = model.embed.weight
        self.dtype, self.device = param.dtype, param.device
        self.prepacked = can_prepack(self.dtype, self.device) if prepack is None else prepack
        if self.prepacked:
            for layer in model.layers:
                prepack_linears(layer)
        if head is not None:
            self._head = head
        elif self.prepacked:
            self._head = PackedLinear(model.lm_weight())  # lm_weight() stays for refinement
        else:
            self._head = lambda x: F.linear(x, model.lm_weight())
        # [V, D]: the rows the head computes, refined from (None: a head of its own)
        self._head_weight = None if head is not None else model.lm_weight()
        self._vocab_ids: torch.Tensor | None = None  # [N]: set by limit_vocab
        self.invariant = invariant and self.prepacked
        self._set_invariant()
        self._capacity = min(capacity, cfg.context_length)
        shape = (cfg.n_layers, cfg.n_kv_heads, self._capacity, cfg.head_dim)
        self.k_cache = lazy_zeros(shape, self.dtype, self.device)  # resident once written
        self.v_cache = lazy_zeros(shape, self.dtype, self.device)
        self.cos, self.sin = rope_tables(cfg, self._capacity, self.dtype, self.device)
        self._length = 0
        self.out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32  # logits
        self._static_on = self.device.type == "cuda" if static is None else static
        self._spans = spans
        self._static = self._new_static()
        graphs = self._static_on and self.device.type == "cuda"
        self.capabilities = Capabilities(hidden_layers=True, final_hidden=True,
                                         reduced_vocab=True, static_passes=self._static_on,
                                         cuda_graphs=graphs, skip_layers=True,
                                         resume_rows=True)
        self.curve = None  # forerun.profile's calibration, at its first use

    def set_invariant(self, on: bool) -> None:
        """Turn the row-invariant kernels (see `invariant` above) on or off, for the model's
        forks and batched views too; prepacked models only (elsewhere it stays off)."""
        self.invariant = on and self.prepacked
        self._set_invariant()

    def _set_invariant(self) -> None:
        """Row-invariant kernels on every prepacked linear and attention of the model."""
        for module in [*self.model.modules(), self._head]:
            if isinstance(module, PackedLinear | Block):
                module.invariant = self.invariant

    def _new_static(self) -> StaticPasses | None:
        return (StaticPasses(self, graphs=self.device.type == "cuda", spans=self._spans)
                if self._static_on else None)

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    def warm_up(self, max_tokens: int | None = None) -> int:
        """Record the static passes of every padded size (up to `max_tokens` new tokens) now
        rather than at their first use, where a request would wait for them: on a GPU each
        size's first pass captures its CUDA graph (H100: ~50 ms) and, the first time in the
        process, sets up the attention kernel for its shape (cuDNN: up to ~1 s a shape; see
        README, On a GPU). The passes run past the cache's length and are truncated away, so
        the cache keeps what it holds. A no-op without static passes (the CPU's default).
        -> how many sizes ran."""
        if self._static is None:
            return 0
        start, ran = self._length, 0
        for size in self._static.sizes:
            if (max_tokens is not None and size > max_tokens) or not self._static.fits(start, size):
                break
            self.forward(torch.zeros(size, dtype=torch.long))
            self.truncate(start)
            ran += 1
        return ran

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        self._length = length

    def keep(self, start: int, rows: list[int]) -> None:
        """Compact a tree pass to its accepted path: slots start+rows[j] move to start+j."""
        if rows and not (rows[0] >= 0 and start + rows[-1] < self._length):
            raise ValueError(f"rows {rows} are not in the last pass "
                             f"({self._length - start} tokens)")
        src = torch.tensor(rows, device=self.device) + start  # [n]
        dst = start + len(rows)
        self.k_cache[:, :, start:dst] = self.k_cache[:, :, src]  # [L, Hkv, n, hd]
        self.v_cache[:, :, start:dst] = self.v_cache[:, :, src]
        self._length = dst

    def fork(self) -> TorchRuntime:
        """One more sequence: the same (shared, never copied) weights, an empty cache of its own."""
        twin = copy.copy(self)
        shape = tuple(self.k_cache.shape)
        twin.k_cache = lazy_zeros(shape, self.dtype, self.device)
        twin.v_cache = lazy_zeros(shape, self.dtype, self.device)
        twin._length = 0
        twin._static = twin._new_static()  # graphs write this cache: the twin records its own
        twin.curve = None  # its own, measured at its first use
        return twin

    def without_layers(self, skip: Collection[int], capacity: int | None = None
                       ) -> TorchRuntime:
        """A draft of this model with the layers `skip` left out (layer-skip
        self-speculation): the same weights, prepacked ones and the LM head included (shared,
        never copied), and an empty cache of its own over the kept layers (`capacity` slots,
        at most this one's): skipping a layer changes every later layer's input, so the
        target's K/V past it are not the draft's."""
        n = self.config.n_layers
        skip = set(skip)
        if not skip <= set(range(n)) or len(skip) >= n:
            raise ValueError(f"layers to skip must lie in 0..{n - 1} and leave one, got "
                             f"{sorted(skip)}")
        twin = copy.copy(self)
        twin.model = self.model.without_layers(skip)
        twin.config = twin.model.cfg
        twin._capacity = min(capacity or self._capacity, self._capacity)
        shape = (twin.config.n_layers, self.config.n_kv_heads, twin._capacity,
                 self.config.head_dim)
        twin.k_cache = lazy_zeros(shape, self.dtype, self.device)
        twin.v_cache = lazy_zeros(shape, self.dtype, self.device)
        twin._length = 0
        twin._static = twin._new_static()
        twin.curve = None
        return twin

    def limit_vocab(self, ids) -> None:
        """Compute logits for the tokens `ids` only; every other token gets logit -inf.

        For drafters (FR-Spec, EAGLE-3): the LM head is the largest matmul of a small model
        (Qwen's is 151,936 rows), and most rows are tokens that almost never occur. A drafter
        that cannot propose them stays lossless, because the target verifies over its full
        vocabulary; it only loses the rare acceptance. Shared weights are not changed: the
        kept rows are copied (and prepacked) for this runtime alone.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).unique()  # [N] sorted
        if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"vocabulary ids must lie in 0..{self.config.vocab_size - 1}")
        weight = self.model.lm_weight().detach()[ids.to(self.device)].contiguous()  # [N, D]
        self._head = PackedLinear(weight) if self.prepacked else (lambda x: F.linear(x, weight))
        self._set_invariant()
        self._head_weight, self._vocab_ids = weight, ids.to(self.device)
        self._static = self._new_static()  # recorded passes hold the old head

    @torch.inference_mode()
    def forward(self, tokens, *, positions=None, tree_mask=None, last_only=False,
                hidden_layers=(), hidden_from=0, resume: Resume | None = None) -> ForwardOutput:
        """`resume`: the pass's first rows enter at layer resume.layer from resume.hidden (their
        lower layers' K/V already cached: an early-exit draft's); layers below it run the
        other rows only. Chains only."""
        start, T = self._length, tokens.shape[0]
        if start + T > self._capacity:
            raise ValueError(f"context full: {start} + {T} tokens > capacity {self._capacity}")
        if resume is not None:
            return self._resumed(tokens, resume, last_only, hidden_layers, hidden_from,
                                 positions is not None or tree_mask is not None)
        if self._static is not None and self._static.fits(start, T, hidden_layers):
            logits, h = self._static.forward(tokens, positions, tree_mask, start)
            self._length = start + T
            hidden = {-1: h[hidden_from:]} if -1 in hidden_layers else {}  # as below
            return ForwardOutput((logits[-1:] if last_only else logits).cpu(), hidden)
        tokens = tokens.to(self.device)
        if positions is None:
            positions = torch.arange(start, start + T, device=self.device)
        cos, sin = self.cos[positions], self.sin[positions]  # [T, hd]
        mask = self._mask(start, T, tree_mask)
        x = self.model.embed(tokens)  # [T, D]
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, self.k_cache[i], self.v_cache[i], start, mask)
            if i in hidden_layers:
                hidden[i] = x
        if -1 in hidden_layers:  # every row, even under last_only (a head's prefill needs them)
            h, logits = self.head(x, last_only)
            hidden[-1] = h
        else:
            _, logits = self.head(x[-1:] if last_only else x)
        self._length = start + T
        # Sampling and verification run on the CPU with a CPU generator: [T, V] is a small copy.
        return ForwardOutput(logits.cpu(), {i: h[hidden_from:] for i, h in hidden.items()})

    def _resumed(self, tokens, resume: Resume, last_only: bool, hidden_layers, hidden_from,
                 tree: bool) -> ForwardOutput:
        """A chain pass whose first m rows start at layer E = resume.layer: layers 0..E-1 run
        rows m.. only (written at their slots, attending to the cached lower K/V of the rows
        before them), layers E.. every row."""
        start, T, E, m = self._length, tokens.shape[0], resume.layer, resume.rows
        if tree or not 0 < E < self.config.n_layers or not 0 < m <= T or any(
                0 <= i < E for i in hidden_layers):
            raise ValueError(f"resume: a chain pass of {T} rows resumes 1..{T} rows at a layer "
                             f"in 1..{self.config.n_layers - 1} and returns no layer below it; got "
                             f"{m} rows at layer {E}, layers {list(hidden_layers)}")
        positions = torch.arange(start, start + T, device=self.device)
        cos, sin = self.cos[positions], self.sin[positions]  # [T, hd]
        x = self.model.embed(tokens[m:].to(self.device))  # [T - m, D]: the rows run in full
        hidden = {}
        for i, layer in enumerate(self.model.layers):
            if i == E:  # the resumed rows join: every row from here on
                x, m = torch.cat([resume.hidden.to(x.dtype), x]), 0  # [T, D]
            if x.shape[0]:
                x = layer(x, cos[m:], sin[m:], self.k_cache[i], self.v_cache[i], start + m,
                          self._mask(start + m, T - m, None))
            if i in hidden_layers:
                hidden[i] = x
        h, logits = self.head(x, last_only)  # [T, D], [T or 1, V]
        if -1 in hidden_layers:
            hidden[-1] = h
        self._length = start + T
        return ForwardOutput(logits.cpu(), {i: v[hidden_from:] for i, v in hidden.items()})

    def head(self, x: torch.Tensor, last_only: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output x [T, D] -> (final normed hidden [T, D], logits [T, V] or
        [1, V] under last_only: float32 (float64 for a float64 model), -inf outside a limited
        vocabulary)."""
        h = rms_norm(x, self.model.norm, self.config.norm_eps)
        rows = h[-1:] if last_only else h
        logits = self._head(rows)  # [T, V], or [T, N] under limit_vocab
        if self.dtype in LOW_PRECISION and self._head_weight is not None:
            logits = refine_top_logits(logits, rows, self._head_weight)
        if self._vocab_ids is not None:  # back to [T, V], -inf outside the kept tokens
            logits = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf")
                                     ).index_copy_(1, self._vocab_ids, logits)
        return h, logits.to(self.out_dtype)

    def _mask(self, start: int, T: int, tree_mask) -> torch.Tensor | None:
        """[T, start+T] bool: every cached slot, then causal (or the tree) among the new tokens."""
        if T == 1 and tree_mask is None:
            return None
        new = tree_mask if tree_mask is not None else torch.ones(T, T, dtype=torch.bool).tril()
        prefix = torch.ones(T, start, dtype=torch.bool)
        return torch.cat([prefix, new.bool()], dim=1).to(self.device)
