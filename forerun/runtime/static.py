"""Static-shape forward passes for the torch runtime, replayed as CUDA graphs on a GPU.

Owns: the decode-sized passes (1 to STATIC_SIZES[-1] new tokens) of a `TorchRuntime` in a form
whose shapes and addresses never change, so each size is captured once as a CUDA graph and then
replayed with one launch. On a GPU a 1.5B model's eager pass is bound by the host launching a
few hundred small kernels (H200: 14 ms a pass, the GPU busy a fraction of it); a replay is not.

A pass over T tokens runs at the smallest captured size B >= T, padded:
- inputs go through one host buffer into a static device buffer: token ids [B], RoPE positions
  [B], the cache offset `start`, and the new tokens' mask among themselves [B, B] (causal for a
  chain, the tree's for a tree; padded rows see only themselves);
- every layer writes its K/V at cache slots start..start+B-1 (`index_copy_`, so the slots are
  data, not shapes) and attends over the whole cache under a mask built on the device: slots
  before `start`, then the new rows the [B, B] mask allows. Slots past the T real ones take
  padding's K/V, which nothing reads before a later pass overwrites them (the runtime's length
  says what is valid);
- logits [B, V] (float32, refined as the eager pass refines low precision) and the final normed
  hidden state [B, D] land in static outputs, copied out after the replay.
On the CPU (tests) the same static pass runs eagerly, so its masking and padding are checked
against the plain forward without a GPU. Passes with more tokens (prompts), other hidden layers
than the final one, or too close to the end of the cache take the plain eager forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

STATIC_SIZES = (1, 2, 4, 8, 16, 32, 64)  # padded pass sizes, each captured at its first use


class StaticPasses:
    """The static passes of one runtime (its KV cache): buffers and graphs per padded size."""

    def __init__(self, runtime, graphs: bool):
        self.rt, self.graphs = runtime, graphs
        self.sizes = tuple(b for b in STATIC_SIZES if b <= runtime.capacity)
        self._passes: dict[int, _Pass] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def fits(self, start: int, T: int, hidden_layers) -> bool:
        return (0 < T <= self.sizes[-1] and set(hidden_layers) <= {-1}
                and start + self.bucket(T) <= self.rt.capacity)

    def bucket(self, T: int) -> int:
        return next(b for b in self.sizes if b >= T)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None,
                tree_mask: torch.Tensor | None, start: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [T, V] float32, final normed hidden [T, D]) on the device; the hidden
        rows are a copy (the static buffer is overwritten by the next pass)."""
        T = tokens.shape[0]
        B = self.bucket(T)
        p = self._passes.get(B)
        if p is None:
            p = self._passes[B] = _Pass(self.rt, B)
        p.load(tokens, positions, tree_mask, start)
        if not self.graphs:
            p.run()
        elif p.graph is None:
            p.capture(self._pool)
        else:
            p.graph.replay()
        return p.logits[:T], p.hidden[:T].clone()


class _Pass:
    """One padded size B: static inputs and outputs, the pass over them, its graph."""

    def __init__(self, rt, B: int):
        self.rt, self.B, self.graph = rt, B, None
        dev, C = rt.device, rt.capacity
        # host staging, one copy in: tokens [B], positions [B], start [1], new-token mask [B*B]
        self.host = torch.zeros(2 * B + 1 + B * B, dtype=torch.long,
                                pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros_like(self.host, device=dev)
        self.tokens, self.positions = self.inputs[:B], self.inputs[B:2 * B]
        self.start, self.new_mask = self.inputs[2 * B:2 * B + 1], self.inputs[2 * B + 1:
                                                                               2 * B + 1 + B * B]
        self.offsets = torch.arange(B, device=dev)  # [B]
        self.columns = torch.arange(C, device=dev)  # [C]
        out = torch.float64 if rt.dtype == torch.float64 else torch.float32
        self.logits = torch.zeros(B, rt.config.vocab_size, dtype=out, device=dev)  # [B, V]
        self.hidden = torch.zeros(B, rt.config.dim, dtype=rt.dtype, device=dev)  # [B, D]

    def load(self, tokens, positions, tree_mask, start: int) -> None:
        B, T, h = self.B, tokens.shape[0], self.host
        h.zero_()
        h[:T] = tokens.to("cpu", torch.long)
        pos = torch.arange(start, start + B).clamp_max(self.rt.capacity - 1)  # padding: any
        if positions is not None:
            pos[:T] = positions.to("cpu", torch.long)
        h[B:2 * B] = pos
        h[2 * B] = start
        m = torch.eye(B, dtype=torch.long)  # padded rows see themselves (no empty row)
        m[:T, :T] = (tree_mask.to("cpu", torch.long) if tree_mask is not None else
                     torch.ones(T, T, dtype=torch.long).tril())
        h[2 * B + 1:] = m.view(-1)
        self.inputs.copy_(h, non_blocking=True)

    def run(self) -> None:
        """The pass over the static buffers (what the graph records)."""
        rt, B = self.rt, self.B
        model = rt.model
        slots = self.start + self.offsets  # [B] cache slots of the new rows
        rel = self.columns - self.start  # [C] column's offset from start
        new = self.new_mask.view(B, B).bool()[:, rel.clamp(0, B - 1)]  # [B, C]
        mask = (rel < 0)[None, :] | (new & (rel < B)[None, :])  # [B, C] bool
        cos, sin = rt.cos[self.positions], rt.sin[self.positions]  # [B, hd]
        x = model.embed(self.tokens)  # [B, D]
        for i, layer in enumerate(model.layers):
            x = static_block(layer, x, cos, sin, rt.k_cache[i], rt.v_cache[i], slots, mask)
        h, logits = rt.head(x)
        self.hidden.copy_(h)
        self.logits.copy_(logits)

    def capture(self, pool) -> None:
        """Warm up on a side stream (the same inputs: its cache writes are the pass's own),
        record the pass, then replay it once for the call that asked."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.run()
        self.graph.replay()


def static_block(layer, x, cos, sin, k_cache, v_cache, slots, mask):
    """`Block.forward` with data-dependent cache slots: x [B, D]; k_cache, v_cache [Hkv, C, hd];
    slots [B]; mask [B, C] bool over the whole cache."""
    from forerun.runtime.torch_model import apply_rope, rms_norm

    cfg, B = layer.cfg, x.shape[0]
    qkv = layer.wqkv(rms_norm(x, layer.attn_norm, cfg.norm_eps))  # [B, (H+2Hkv)*hd]
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    q = apply_rope(q.view(B, cfg.n_heads, -1).transpose(0, 1), cos, sin)  # [H, B, hd]
    k = apply_rope(k.view(B, cfg.n_kv_heads, -1).transpose(0, 1), cos, sin)  # [Hkv, B, hd]
    k_cache.index_copy_(1, slots, k)
    v_cache.index_copy_(1, slots, v.view(B, cfg.n_kv_heads, -1).transpose(0, 1))
    attn = F.scaled_dot_product_attention(
        q.unsqueeze(0), k_cache.unsqueeze(0), v_cache.unsqueeze(0),
        attn_mask=mask, enable_gqa=True)  # [1, H, B, hd]
    x = x + layer.wo(attn[0].transpose(0, 1).reshape(B, layer.q_size))
    gate, up = layer.w_gate_up(rms_norm(x, layer.ffn_norm, cfg.norm_eps)).chunk(2, dim=-1)
    return x + layer.w_down(F.silu(gate) * up)
