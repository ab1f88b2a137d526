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

`StaticHeadSteps` does the same for an EAGLE head's step (1-32 rows: catching up with the
target), over one proposer's head cache, and `StaticEagleTree` for the whole draft tree after
it: every level grown on the device, one copy back to the host a draft.
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F

STATIC_SIZES = (1, 2, 4, 8, 16, 32, 64)  # padded pass sizes, each captured at its first use


class Recorded:
    """Padded sizes of one static pass over one cache of `capacity` slots, each size's buffers
    (and graph) made at its first use by `_make(B)`; a pass of T rows at start runs at the
    smallest size B >= T, where slots start..start+B-1 exist."""

    def __init__(self, sizes: tuple[int, ...], capacity: int, graphs: bool):
        self.capacity, self.graphs = capacity, graphs
        self.sizes = tuple(b for b in sizes if b <= capacity)
        self._sized: dict = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def fits(self, start: int, T: int) -> bool:
        return 0 < T <= self.sizes[-1] and start + self.bucket(T) <= self.capacity

    def bucket(self, T: int) -> int:
        return next(b for b in self.sizes if b >= T)

    def _play(self, T: int, *inputs, span: int | None = None):
        """Load `inputs` into size bucket(T)'s buffers (for attention over the first `span`
        cache slots, where the subclass has spans) and run it: eagerly (CPU), else its graph,
        recorded at first use. -> that size's buffers."""
        B = self.bucket(T)
        key = B if span is None else (B, span)
        p = self._sized.get(key)
        if p is None:
            p = self._sized[key] = self._make(B, span)
        p.load(*inputs)
        launch(p, self.graphs, self._pool)
        return p


class StaticPasses(Recorded):
    """The static passes of one runtime (its KV cache): buffers and graphs per padded size."""

    def __init__(self, runtime, graphs: bool, spans: bool = False):
        super().__init__(STATIC_SIZES, runtime.capacity, graphs)
        self.rt, self.spans = runtime, spans

    def fits(self, start: int, T: int, hidden_layers=()) -> bool:
        return set(hidden_layers) <= {-1} and super().fits(start, T)

    def _make(self, B: int, span: int | None = None) -> _Pass:
        return _Pass(self.rt, B, span)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None,
                tree_mask: torch.Tensor | None, start: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [T, V] float32, final normed hidden [T, D]) on the device; the hidden
        rows are a copy (the static buffer is overwritten by the next pass)."""
        T = tokens.shape[0]
        span = span_of(start + self.bucket(T), self.capacity) if self.spans else None
        p = self._play(T, tokens, positions, tree_mask, start, span=span)
        return p.logits[:T], p.hidden[:T].clone()


class _Pass:
    """One padded size B: static inputs and outputs, the pass over them, its graph; with a
    `span`, attention over the cache's first `span` slots only."""

    def __init__(self, rt, B: int, span: int | None = None):
        self.rt, self.B, self.graph = rt, B, None
        dev, C = rt.device, span or rt.capacity
        # host staging, one copy in: tokens [B], positions [B], start [1], new-token mask [B*B]
        self.host = torch.zeros(2 * B + 1 + B * B, dtype=torch.long,
                                pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros_like(self.host, device=dev)
        self.tokens, self.positions = self.inputs[:B], self.inputs[B:2 * B]
        self.start, self.new_mask = self.inputs[2 * B:2 * B + 1], self.inputs[2 * B + 1:
                                                                               2 * B + 1 + B * B]
        self.offsets = torch.arange(B, device=dev)  # [B]
        self.columns = torch.arange(C, device=dev)  # [C]
        self.logits = torch.zeros(B, rt.config.vocab_size, dtype=rt.out_dtype, device=dev)
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
        C = self.columns.shape[0]  # the span (the whole cache without one)
        for i, layer in enumerate(model.layers):
            x = static_block(layer, x, cos, sin, rt.k_cache[i, :, :C], rt.v_cache[i, :, :C],
                             slots, mask)
        h, logits = rt.head(x)
        self.hidden.copy_(h)
        self.logits.copy_(logits)

def static_block(layer, x, cos, sin, k_cache, v_cache, slots, mask, span: int | None = None):
    """`Block.forward` with data-dependent cache slots: x [B, D]; k_cache, v_cache [Hkv, C, hd];
    slots [B]; mask [B, C] bool over the whole cache (with a `span`: [B, span] over its first
    `span` slots, the rows still writing anywhere in it)."""
    q, k, v = layer.qkv(x, cos, sin)  # [H, B, hd], [Hkv, B, hd] x2
    k_cache.index_copy_(1, slots, k)
    v_cache.index_copy_(1, slots, v)
    keys, values = (k_cache, v_cache) if span is None else (k_cache[:, :span], v_cache[:, :span])
    attn = F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
        attn_mask=mask, enable_gqa=True)  # [1, H, B, hd]
    return layer.finish(x, attn)


def top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, dim=-1) of a few long rows x [R, N], in two stages where N splits into
    chunks of 256: each chunk's top k, then the top k of those. torch's single-block top-k
    gives a row one block (H100: 72 us for a few rows of 16,384); chunks spread it over many.
    Equal values may come in another order than topk's."""
    R, N = x.shape
    if N % 256 or N < 2048 or k > 32:
        return x.topk(k, dim=-1)
    v, i = x.view(R, N // 256, 256).topk(k, dim=-1)  # [R, N/256, k]
    i = i + torch.arange(0, N, 256, device=x.device)[:, None]
    best, j = v.reshape(R, -1).topk(k, dim=-1)  # [R, k]
    return best, i.reshape(R, -1).gather(-1, j)


HEAD_SIZES = (1, 2, 4, 8, 16, 32)  # padded rows of an EAGLE head step
MIN_SPAN = 256  # a static pass with spans attends over the first 256, 512, 1024, ... slots


def span_of(end: int, capacity: int) -> int:
    """The attention span of a static pass whose rows end before cache slot `end`: the
    smallest power of two >= end, at least MIN_SPAN, at most the cache. A head's drafts do
    not change the output, so their numerics may depend on the span; attending over the whole
    cache made a head step's attention most of its time (H100, a 2,304-slot cache: ~130 of
    ~280 us, the math kernel's matmuls over every slot). A target's passes take spans only
    with `spans=True` (experimental): the same position computed at two spans may round
    differently, and that is not yet checked on a GPU."""
    span = MIN_SPAN
    while span < end:
        span *= 2
    return min(span, capacity)


class StaticHeadSteps(Recorded):
    """An EAGLE head's step (fc, its decoder layer, logits, log-softmax) in static shapes over
    one proposer's head cache, replayed as CUDA graphs on a GPU (eagerly on the CPU, in tests).
    A step of T rows runs at the smallest size B >= T: rows past T are padding that sees only
    its own slot; the mask over the cache comes in whole ([B, C], built on the host), since a
    draft node attends to its ancestors' slots, not to a causal block."""

    def __init__(self, heads, k_cache: torch.Tensor, v_cache: torch.Tensor, graphs: bool):
        super().__init__(HEAD_SIZES, k_cache.shape[1], graphs)
        self.heads, self.k_cache, self.v_cache = heads, k_cache, v_cache
        self.tree = StaticEagleTree(heads, k_cache, v_cache, graphs)  # the draft tree's levels

    def _make(self, B: int, span: int) -> _HeadStep:
        return _HeadStep(self, B, span)

    def step(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             slot: int, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """features [T, D] (device), tokens and positions [T] (host), new rows at cache slots
        slot.., mask [T, slot+T] bool (None: every earlier slot and its own) -> (o [T, D],
        log-probabilities [T, N]), copies of the static outputs."""
        T = features.shape[0]
        s = self._play(T, features, tokens, positions, slot, mask,
                       span=span_of(slot + self.bucket(T), self.capacity))
        return s.o[:T].clone(), s.logprobs[:T].clone()


class _HeadStep:
    def __init__(self, owner: StaticHeadSteps, B: int, span: int):
        self.owner, self.B, self.span, self.graph = owner, B, span, None
        heads, C = owner.heads, span  # the mask covers the span only: nothing attends past it
        dev, pin = heads.device, heads.device.type == "cuda"
        D, N = heads.cfg.dim, heads.vocab_ids.shape[0]
        self.host = torch.zeros(2 * B + 1, dtype=torch.long, pin_memory=pin)
        self.host_mask = torch.zeros(B, C, dtype=torch.bool, pin_memory=pin)
        self.inputs = torch.zeros_like(self.host, device=dev)
        self.tokens, self.positions, self.slot = (self.inputs[:B], self.inputs[B:2 * B],
                                                  self.inputs[2 * B:])
        self.mask = torch.zeros_like(self.host_mask, device=dev)  # [B, C]
        self.features = torch.zeros(B, D, device=dev)  # [B, D] float32
        self.offsets = torch.arange(B, device=dev)
        self.o = torch.zeros(B, D, device=dev)
        self.logprobs = torch.zeros(B, N, device=dev)

    def load(self, features, tokens, positions, slot: int, mask) -> None:
        B, T, h, hm = self.B, features.shape[0], self.host, self.host_mask
        h.zero_()
        h[:T] = tokens
        pos = torch.full((B,), int(positions[-1]))  # padding: any position in the table
        pos[:T] = positions
        h[B:2 * B] = pos
        h[2 * B] = slot
        hm.zero_()
        if mask is None:
            hm[:T, :slot + T] = torch.ones(T, slot + T, dtype=torch.bool).tril(slot)
        else:
            hm[:T, :slot + T] = mask
        hm[torch.arange(T, B), slot + torch.arange(T, B)] = True  # padding sees itself
        self.inputs.copy_(h, non_blocking=True)
        self.mask.copy_(hm, non_blocking=True)
        self.features[:T] = features
        self.features[T:] = 0

    def run(self) -> None:
        owner = self.owner
        heads = owner.heads
        x = heads.fc(torch.cat([self.features, heads.embed_of(self.tokens)], dim=-1))  # [B, D]
        cos, sin = heads.cos[self.positions], heads.sin[self.positions]
        S = self.span
        out = static_block(heads.layer, x, cos, sin, owner.k_cache[:, :S],
                           owner.v_cache[:, :S], self.slot + self.offsets, self.mask)
        self.o.copy_(out)
        self.logprobs.copy_(heads.logits(out).log_softmax(-1))


def tree_shape(depth: int, topk: int, beam: int, vocab: int) -> list[tuple[int, int]]:
    """Per level of an EAGLE-2 tree grown in static shapes: (nodes expanded, nodes found);
    level 1 expands the root alone."""
    width, levels = min(topk, vocab), []
    found = width
    levels.append((1, found))
    for _ in range(2, depth + 1):
        expanded = min(beam, found)
        found = expanded * width
        levels.append((expanded, found))
    return levels


class StaticEagleTree:
    """EAGLE-2's dynamic tree (`forerun.tree.grow_tree`) grown on the device, in static shapes:
    from the root's output and log-probabilities, every level picks its `beam` likeliest nodes
    (top-k of the path log-probabilities), runs the head's step over them (their slots after
    the committed ones, each attending to the committed entries, its ancestors and itself) and
    takes each one's `topk` children, without a round trip to the host; the grown candidates
    (path log-probabilities, draft-vocabulary tokens, parents) come back in one copy, for the
    host to rerank and prune (`forerun.tree.prune`). On a GPU each (depth, topk, beam,
    attention span) is one CUDA graph, recorded at first use; eagerly on the CPU (tests). It
    grows every level it is asked for, where grow_tree with a budget function stops expanding
    nodes the budget would not carry (the proposer sizes an automatic budget's depth from its
    last cuts instead: `forerun.propose.heads.next_depth`)."""

    def __init__(self, heads, k_cache: torch.Tensor, v_cache: torch.Tensor, graphs: bool):
        self.heads, self.k_cache, self.v_cache, self.graphs = heads, k_cache, v_cache, graphs
        self.capacity = k_cache.shape[1]
        self._shaped: dict = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def _end(self, slot: int, depth: int, topk: int, beam: int) -> int:
        """The cache slot past the last node the tree's levels take, from `slot`."""
        levels = tree_shape(depth, topk, beam, self.heads.vocab_ids.shape[0])
        return slot + sum(expanded for expanded, _ in levels[1:])

    def fits(self, slot: int, depth: int, topk: int, beam: int) -> bool:
        return depth >= 1 and self._end(slot, depth, topk, beam) <= self.capacity

    def grow(self, root_o: torch.Tensor, root_lp: torch.Tensor, root_pos: int, slot: int,
             depth: int, topk: int, beam: int) -> tuple[list[float], list[int], list[int]]:
        """root_o [1, D] and root_lp [N] (device): the head's output and log-probabilities at
        the last committed entry, sequence position root_pos; nodes take cache slots slot..
        -> (path log-probabilities, tokens, parents) of every grown node, level by level."""
        end = self._end(slot, depth, topk, beam)
        key = (depth, topk, beam, span_of(end, self.capacity))
        g = self._shaped.get(key)
        if g is None:
            g = self._shaped[key] = _Grow(self, *key)
        g.load(root_o, root_lp, root_pos, slot)
        launch(g, self.graphs, self._pool)
        scores, tokens, parents = g.out.cpu()  # [3, M] float64: one copy to the host
        return scores.tolist(), tokens.long().tolist(), parents.long().tolist()


class _Grow:
    def __init__(self, owner: StaticEagleTree, depth: int, topk: int, beam: int, span: int):
        self.owner, self.span, self.graph = owner, span, None
        heads, C = owner.heads, span  # attention over the first `span` cache slots
        dev, pin = heads.device, heads.device.type == "cuda"
        N = heads.vocab_ids.shape[0]
        self.levels = tree_shape(depth, topk, beam, N)
        self.width = min(topk, N)
        self.host = torch.zeros(2, dtype=torch.long, pin_memory=pin)  # root position, slot
        self.inputs = torch.zeros_like(self.host, device=dev)
        self.root_o = torch.zeros(1, heads.cfg.dim, device=dev)  # [1, D]
        self.root_lp = torch.zeros(N, device=dev)  # [N]
        self.columns = torch.arange(C, device=dev)  # [C]
        self.offsets = torch.arange(max(e for e, _ in self.levels), device=dev)
        self.out = torch.zeros(3, sum(f for _, f in self.levels), dtype=torch.float64,
                               device=dev)  # [3, M] scores, tokens, parents

    def load(self, root_o, root_lp, root_pos: int, slot: int) -> None:
        self.host[0], self.host[1] = root_pos, slot
        self.inputs.copy_(self.host, non_blocking=True)
        self.root_o.copy_(root_o)
        self.root_lp.copy_(root_lp)

    def run(self) -> None:
        owner = self.owner
        heads, W = owner.heads, self.width
        root_pos, slot = self.inputs[0], self.inputs[1]
        scores, tokens = top(self.root_lp[None], W)  # level 1: the root's children
        scores, tokens = scores[0], tokens[0]  # [W]
        parents = torch.full_like(tokens, -1)
        index = torch.arange(W, device=tokens.device)  # level's nodes' indices among all
        outputs = self.root_o.expand(W, -1)  # [L, D] each node's parent's output
        masks = (self.columns < slot).expand(W, -1)  # [L, C] its parent's view of the cache
        found, used, count = [(scores, tokens, parents)], 0, W
        for d, (E, L) in enumerate(self.levels[1:], start=2):
            best, pick = scores.topk(E)  # [E] the level's likeliest nodes, best first
            slots = slot + used + self.offsets[:E]  # [E]
            used += E
            mask = masks[pick] | (self.columns[None, :] == slots[:, None])  # [E, C]
            ids = heads.vocab_ids[tokens[pick]]  # [E] target ids
            x = heads.fc(torch.cat([outputs[pick], heads.embed_of(ids)], dim=-1))  # [E, D]
            pos = (root_pos + d - 1).expand(E)  # a node at depth d-1
            cos, sin = heads.cos[pos], heads.sin[pos]
            S = self.span
            out = static_block(heads.layer, x, cos, sin, owner.k_cache[:, :S],
                               owner.v_cache[:, :S], slots, mask)  # [E, D]
            v, t = top(heads.logits(out).log_softmax(-1), W)  # [E, W]
            scores, tokens = (best[:, None] + v).reshape(L), t.reshape(L)
            parents = index[pick][:, None].expand(E, W).reshape(L)  # [L]
            index = count + torch.arange(L, device=tokens.device)
            count += L
            outputs = out[:, None].expand(E, W, -1).reshape(L, -1)  # [L, D]
            masks = mask[:, None].expand(E, W, -1).reshape(L, -1)  # [L, C]
            found.append((scores, tokens, parents))
        self.out[0].copy_(torch.cat([s for s, _, _ in found]))
        self.out[1].copy_(torch.cat([t for _, t, _ in found]))
        self.out[2].copy_(torch.cat([p for _, _, p in found]))


def launch(p, graphs: bool, pool) -> None:
    """Run a static pass `p` over its loaded buffers: eagerly (the CPU), else its CUDA graph,
    recorded at first use."""
    if not graphs:
        p.run()
    elif p.graph is None:
        _capture(p, pool)
    else:
        p.graph.replay()


def _capture(p, pool) -> None:
    """Warm up on a side stream (the same inputs: its cache writes are the pass's own), record
    the pass as a CUDA graph, then replay it once for the call that asked."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        p.run()
    torch.cuda.current_stream().wait_stream(stream)
    p.graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()  # a collection during capture may free another object's graph, which
    try:  # invalidates this capture (seen: CUBLAS_STATUS_EXECUTION_FAILED, H100)
        with torch.cuda.graph(p.graph, pool=pool):  # (it collects once before capturing)
            p.run()
    finally:
        if collecting:
            gc.enable()
    p.graph.replay()
