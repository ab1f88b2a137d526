"""A low-precision copy of the torch model's weights, for a draft that is the target itself
(QSpec, Zhao et al. 2024: the same weights at lower precision draft, the full-precision model
verifies, so the output is the full-precision model's).

Owns: `QuantLinear` (one linear layer in a precision of PRECISIONS) and `quantized_runtime`
(a TorchRuntime over the target's model whose every linear layer, the LM head included, is a
QuantLinear: a copy in the new precision; the embeddings and norms are shared, never copied; an
empty KV cache of its own, since different weights give different keys and values). Never
changes the target.

The precisions, on torch's own CPU kernels (no extra package):
- int8: symmetric int8 weights, one scale per output row (W8A16, gpt-fast's int8 mode:
  `aten._weight_int8pack_mm`), activations in bfloat16;
- w8a8: the same int8 weights, and activations quantized to 8 bits per call (fbgemm's dynamic
  quantized linear: integer dot products), the QSpec draft's W8A8;
- int4: asymmetric 4-bit weights, a scale and a minimum per INT4_GROUP inputs of a row (W4A16,
  gpt-fast's int4 mode: `aten._weight_int4pack_mm_for_cpu`), activations in bfloat16.
Outputs return in the activations' dtype (bfloat16, float32 or float64), so the model's own
norms, attention and residuals run as the target's do.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from forerun.heads import pack_w8a8, w8a8_available
from forerun.runtime.torch_model import Block, PackedLinear, TorchRuntime

PRECISIONS = ("int8", "w8a8", "int4")
INT8_MAX = 127  # symmetric int8: weights in [-127, 127] * scale
INT4_LEVELS = 15  # asymmetric int4: weights in min + [0, 15] * scale
INT4_GROUP = 32  # inputs per int4 scale (llama.cpp's Q4_0 block); the CPU kernel takes 32..256
INT4_ROWS = 16  # the int4 packing wants outputs in multiples of this
INT4_TILES = 1  # inner K tiles of the CPU int4 packing (its only layout)


def available(precision: str) -> bool:
    """Whether this torch build has the kernel of `precision`."""
    if precision == "int8":
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")
    if precision == "w8a8":
        return w8a8_available()
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class QuantLinear(nn.Module):
    """y = x W^T + b with W [O, I] held in `precision` (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, precision: str):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{precision!r}")
        if not available(precision):
            raise ValueError(f"this torch build has no {precision} kernel for the CPU")
        w = weight.detach().float()  # [O, I]
        self.precision, self.out_features = precision, w.shape[0]
        self.bias = None if bias is None else bias.detach().float()  # [O]
        if precision == "int4":
            self._pack_int4(w)
            return
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX  # [O]
        q = (w / scale[:, None]).round().to(torch.int8)  # [O, I]
        if precision == "w8a8":  # fbgemm's packed weight carries the bias
            self.packed = pack_w8a8(q, scale, self.bias)
            return
        self.weight, self.scale = q, scale.bfloat16()  # [O, I] int8, [O]

    def _pack_int4(self, w: torch.Tensor) -> None:
        """w [O, I] float32 -> 4-bit codes per INT4_GROUP inputs, packed for the CPU kernel."""
        rows, cols = w.shape  # O, I
        if cols % INT4_GROUP or rows % INT4_ROWS:
            raise ValueError(f"int4 needs inputs in multiples of {INT4_GROUP} and outputs in "
                             f"multiples of {INT4_ROWS}, got a [{rows}, {cols}] weight; use "
                             "int8")
        groups = w.view(rows, cols // INT4_GROUP, INT4_GROUP)  # [O, G, g]
        low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)  # [O, G, 1]
        scale = ((high - low) / INT4_LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((groups - low) / scale).round().clamp(0, INT4_LEVELS)  # [O, G, g]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.view(rows, cols).to(torch.int32), INT4_TILES)
        # the kernel computes (code - 8) * scale + zero: zero = low + 8 * scale gives the
        # dequantized weight low + code * scale
        zero = low + (INT4_LEVELS + 1) // 2 * scale  # [O, G, 1]
        self.scales_zeros = torch.cat([scale, zero], -1).transpose(0, 1).contiguous(
        ).bfloat16()  # [G, O, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [R, I]
        if self.precision == "w8a8":  # integer kernels; the bias is in the packed weight
            y = torch.ops.quantized.linear_dynamic(rows.float().contiguous(), self.packed, True)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        rows = rows.bfloat16()
        if self.precision == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)  # [R, O]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP,
                                                           self.scales_zeros)  # [R, O]
        y = y.float() if self.bias is None else y.float() + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)


def quantize_linear(linear: nn.Module, precision: str) -> QuantLinear:
    """A QuantLinear of an nn.Linear or of a PackedLinear (its weight read back exactly)."""
    if isinstance(linear, PackedLinear):
        return QuantLinear(linear.dense_weight(), linear.bias, precision)
    return QuantLinear(linear.weight, linear.bias, precision)


def quantized_block(block: Block, precision: str) -> Block:
    """The block with its four linears in `precision`; its norms shared."""
    twin = copy.copy(block)  # a module's copy shares its registries: give it its own
    twin._parameters = dict(block._parameters)  # attn_norm, ffn_norm (shared tensors)
    twin._modules = {name: quantize_linear(m, precision) for name, m in block._modules.items()}
    return twin


def quantized_runtime(target: TorchRuntime, precision: str,
                      capacity: int | None = None) -> TorchRuntime:
    """A draft of `target` with its linear layers and LM head in `precision` (a copy), the
    embeddings and norms shared, and an empty cache of its own of `capacity` slots (default:
    the target's)."""
    model = target.model.without_layers(())  # the same modules, in a model of its own
    model.layers = nn.ModuleList(quantized_block(b, precision) for b in target.model.layers)
    head = QuantLinear(target.model.lm_weight(), None, precision)  # [V, D]
    return TorchRuntime(model, capacity or target.capacity, prepack=False, head=head,
                        source=target.source)

