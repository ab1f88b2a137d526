"""`forerun profile gpu`: the torch runtime's device path checked and timed on random-initialised
models of the default pair's real shapes (Qwen2.5-Coder 1.5B target, 0.5B draft). Real weights
are not needed to know what a forward pass costs, and a lent GPU machine has no network.

Owns, in the order `gpu_check` runs them:
1. Greedy equality in float32 (random weights give small logit gaps: bfloat16 would tie too
   often): speculative output (draft model, n-gram, the target drafting for itself, random
   Medusa/Hydra/EAGLE/EAGLE-3 heads as chains, trees and the automatic budget, drafting in
   float32, bfloat16 and int8) equals plain greedy output; CUDA graphs equal eager passes; the
   experimental attention over power-of-two spans of the cache (`spans=True`) equals the whole
   cache. A divergence comes with its top-2 logit gap.
2. The verify curve in `dtype`: forward time over 1..64 new tokens after 200 cached ones, target
   and draft, graphed (the runtime's default on a GPU) and eager, and the target with spans.
3. Decode speed: plain tok/s, and the target as its own draft (every draft accepted: the loop's
   best case, so the machinery's overhead shows), graphed, eager and with spans.
4. Heads' drafting cost: the median ms of a `propose` inside a real decode (`heads_cost`), a
   chain of k, trees of 8 and 32 nodes and EAGLE's automatic budget 16 deep, against a one-token
   target pass; EAGLE three ways: its tree grown on the device (the default), level by level
   through the host, and every step eager.
`small=True` runs the same on tiny shapes: a smoke test, on the CPU too. Prints as it goes
(`report`), returns everything as one dict.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forerun.bench.heads_cost import propose_cost
from forerun.engine import speculative_decode
from forerun.heads import KINDS, HeadConfig, Heads, TargetIO
from forerun.policy import FixedK
from forerun.profile import calibrated_curve, measure_forward_curve
from forerun.propose import AUTO_TREE, AUTO_TREE_MAX, HEAD_PROPOSERS
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.eagle import EagleProposer
from forerun.propose.heads import HeadProposer
from forerun.propose.ngram import NgramProposer
from forerun.reference import plain_decode
from forerun.runtime.base import ModelConfig
from forerun.runtime.torch_model import TorchRuntime, Transformer
from forerun.sampling import SamplingConfig, make_generator


@dataclass(frozen=True)
class Shapes:
    """The models' shapes: the default pair's (read from their GGUF metadata) and heads in the
    trained EAGLE head's shape, or tiny ones."""

    target: dict
    draft: dict
    vocab: int
    head: dict


REAL = Shapes(target=dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960),
              draft=dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864),
              vocab=151_936,
              head=dict(num_heads=4, draft_vocab=16_384, n_heads=12, n_kv_heads=2, ffn_dim=2048))
SMALL = Shapes(target=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
               draft=dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64), vocab=512,
               head=dict(num_heads=4, draft_vocab=16_384, n_heads=4, n_kv_heads=2, ffn_dim=48))
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
PROMPT_TOKENS = 200
EQUALITY_TOKENS = 64  # greedy tokens compared per check
CURVE_REPS, CURVE_WARMUP = 20, 3  # timed and untimed passes per size
# small: a smoke test of every path, not a measurement
SMALL_EQUALITY_TOKENS, SMALL_CURVE_REPS, SMALL_CURVE_WARMUP = 16, 2, 1


@dataclass(frozen=True)
class GpuCheckConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"  # of the timings; equality runs in float32
    max_tokens: int = 128  # decode-speed tokens
    k: int = 4
    precisions: tuple[str, ...] = ("bfloat16", "int8")  # head drafting precisions timed
    small: bool = False  # tiny shapes, short checks, few timed passes

    @property
    def equality_tokens(self) -> int:
        return SMALL_EQUALITY_TOKENS if self.small else EQUALITY_TOKENS

    @property
    def curve_passes(self) -> tuple[int, int]:  # (timed, untimed) per size
        return (SMALL_CURVE_REPS, SMALL_CURVE_WARMUP) if self.small else (CURVE_REPS, CURVE_WARMUP)


def random_runtime(shape: dict, vocab: int, dtype: torch.dtype, device: str, capacity: int,
                   seed: int, **options) -> TorchRuntime:
    """Random weights of `shape`; `options` as TorchRuntime takes them (static, spans)."""
    cfg = ModelConfig(arch="qwen2", vocab_size=vocab, rope_theta=1e6, norm_eps=1e-6,
                      context_length=32_768, qkv_bias=True, tied_embeddings=True, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg).to(dtype).eval()
    return TorchRuntime(model, capacity, **options)


def eager(rt: TorchRuntime) -> TorchRuntime:
    """The same weights, a cache of its own, every pass eager (no CUDA graphs)."""
    return TorchRuntime(rt.model, rt.capacity, static=False)


def spanned(rt: TorchRuntime) -> TorchRuntime:
    """The same weights, a cache of its own, graphed passes attending over power-of-two spans."""
    return TorchRuntime(rt.model, rt.capacity, spans=True)


def decode(target, proposer, prompt: list[int], max_tokens: int, k: int
           ) -> tuple[list[int], float, int]:
    """Greedy output, seconds and steps: plain decoding, or speculative with `proposer`."""
    gen, sampling = make_generator(0), SamplingConfig()
    start, steps, out = time.perf_counter(), 0, []
    loop = (plain_decode(target, prompt, sampling, max_tokens, (), gen) if proposer is None else
            speculative_decode(target, proposer, FixedK(k), prompt, sampling, max_tokens, (), gen))
    for step in loop:
        out += step.tokens
        steps += 1
    return out, time.perf_counter() - start, steps


def random_heads(kind: str, target: TorchRuntime, precision: str, head: dict,
                 seed: int = 0) -> Heads:
    """Heads of `kind` in the `head` shape, random weights, on the target's device, drafting in
    `precision`."""
    cfg = target.config
    hc = HeadConfig(kind, cfg.dim, cfg.vocab_size,
                    layers=(1, cfg.n_layers // 2, -1) if kind == "eagle3" else (-1,),
                    **(head | {"draft_vocab": min(head["draft_vocab"], cfg.vocab_size)}))
    model = target.model
    io = TargetIO(model.embed.weight.detach(), model.lm_weight().detach())
    heads = Heads(hc, torch.arange(hc.draft_vocab), io, context=target.capacity)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    return heads.eval().to(target.device).for_drafting(precision)


def head_proposer(kind: str, target: TorchRuntime, precision: str, tree: int, head: dict,
                  topk: int = 2, graphs: bool | str = True, heads: Heads | None = None,
                  store: dict | None = None) -> HeadProposer:
    """A head proposer as `forerun generate` builds it (EAGLE's steps as CUDA graphs on a GPU,
    its tree grown there); graphs="levels": graphed steps, the tree grown level by level through
    the host; False: every step eager. `store`: the sequence's stores, which an earlier EAGLE
    proposer of these heads left its cache and graphs in (ProposerContext.stores)."""
    heads = heads or random_heads(kind, target, precision, head)
    verify = calibrated_curve(target, AUTO_TREE_MAX + 1) if tree == AUTO_TREE else None
    if HEAD_PROPOSERS[kind] is not EagleProposer:
        return HEAD_PROPOSERS[kind](heads, target.capacity, tree, topk, verify)
    proposer = EagleProposer(heads, target.capacity, tree, topk, verify,
                             static=False if graphs is False else None, store=store)
    if graphs == "levels":
        proposer.tree_on_device = False  # the documented switch the comparison is about
    return proposer


def first_divergence(target, prompt: list[int], a: list[int], b: list[int]) -> dict | None:
    """Where greedy outputs a and b first differ, and the target's top-2 logit gap there."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            target.truncate(0)
            logits = target.forward(torch.tensor(prompt + a[:i]), last_only=True).logits[-1]
            top = logits.topk(2).values
            return {"position": i, "top2_gap": float(top[0] - top[1])}
    return None


def _equal(target, prompt, ref, out) -> dict:
    return {"identical": out == ref, "divergence": first_divergence(target, prompt, ref, out)}


def check_equality(cfg: GpuCheckConfig, shapes: Shapes, prompt: list[int],
                   report: Callable[[str], None]) -> dict:
    """Section 1: greedy equality in float32, every check a row."""
    dev, k, head, n = cfg.device, cfg.k, shapes.head, cfg.equality_tokens
    t32 = random_runtime(shapes.target, shapes.vocab, torch.float32, dev, 1024, seed=0)
    d32 = random_runtime(shapes.draft, shapes.vocab, torch.float32, dev, 1024, seed=1)
    ref, _, _ = decode(t32, None, prompt, n, 0)
    results = {}
    ref_eager, _, _ = decode(eager(t32), None, prompt, n, 0)
    results["graphs vs eager, plain"] = _equal(eager(t32), prompt, ref_eager, ref)
    s32 = spanned(t32)
    ref_spans, _, _ = decode(s32, None, prompt, n, 0)
    results["spans vs whole cache, plain"] = _equal(t32, prompt, ref, ref_spans)
    for name, make in (("self", lambda: DraftModelProposer(s32.fork(), shapes.vocab)),
                       ("eagle-tree8", lambda: head_proposer("eagle", s32, "float32", 8, head))):
        out, _, _ = decode(s32, make(), prompt, n, k)
        results[f"spans {name}"] = _equal(s32, prompt, ref_spans, out)
    checks: dict[str, Callable] = {
        "draft": lambda: DraftModelProposer(d32, shapes.vocab),
        "ngram": lambda: NgramProposer(1, 4),
        "self": lambda: DraftModelProposer(t32.fork(), shapes.vocab)}
    for kind in KINDS:  # heads on the device: trees of 8 nodes, EAGLE also a chain and auto
        checks[f"{kind}-tree8"] = lambda kind=kind: head_proposer(kind, t32, "float32", 8, head)
    checks["eagle-chain"] = lambda: head_proposer("eagle", t32, "float32", 0, head)
    checks["eagle-auto"] = lambda: head_proposer("eagle", t32, "float32", AUTO_TREE, head)
    for precision in ("bfloat16", "int8"):  # drafts may change, the output may not
        checks[f"eagle-tree8-{precision}"] = lambda p=precision: head_proposer(
            "eagle", t32, p, 8, head)
    checks["eagle-tree8-eager"] = lambda: head_proposer("eagle", t32, "float32", 8, head,
                                                        graphs=False)
    checks["eagle-tree8-levels"] = lambda: head_proposer("eagle", t32, "float32", 8, head,
                                                         graphs="levels")
    checks["eagle3-auto16"] = lambda: head_proposer("eagle3", t32, "float32", AUTO_TREE, head)
    checks["eagle-tree8-reused"] = lambda: reused_eagle(t32, prompt, k, head, n)
    for name, make in checks.items():
        try:
            proposer = make()
        except Exception as e:  # e.g. a kernel this torch build lacks on the device
            results[name] = {"error": repr(e)}
            continue
        out, _, _ = decode(t32, proposer, prompt, n, 16 if "16" in name else k)
        results[name] = _equal(t32, prompt, ref, out)
    for name, r in results.items():
        report(f"greedy equality fp32 {name:28s} "
               + ("identical" if r.get("identical") else str(r.get("error") or r["divergence"])))
    return results


def reused_eagle(target: TorchRuntime, prompt: list[int], k: int, head: dict,
                 n: int) -> EagleProposer:
    """A second EAGLE proposer for the same target and heads, as a server's next request gets
    it: after a whole decode of n tokens with the first, it takes over that one's cache and
    graphs."""
    heads, store = random_heads("eagle", target, "float32", head), {}
    decode(target, head_proposer("eagle", target, "float32", 8, head, heads=heads, store=store),
           prompt, n, k)
    return head_proposer("eagle", target, "float32", 8, head, heads=heads, store=store)


def gpu_check(cfg: GpuCheckConfig, report: Callable[[str], None] = print) -> dict:
    """All four sections (see the module docstring); `report` gets each printed line."""
    shapes = SMALL if cfg.small else REAL
    dev, dtype = cfg.device, getattr(torch, cfg.dtype)
    prompt = [int(t) for t in torch.randint(shapes.vocab - 1, (PROMPT_TOKENS,),
                                            generator=make_generator(1))]
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                     "torch": torch.__version__, "dtype": cfg.dtype, "small": cfg.small}
    results["equality"] = check_equality(cfg, shapes, prompt, report)
    if dev == "cuda":
        torch.cuda.empty_cache()

    # 2. Verify curves in the timing dtype: CUDA graphs (the default) and eager.
    target = random_runtime(shapes.target, shapes.vocab, dtype, dev, 2048, seed=0)
    draft = random_runtime(shapes.draft, shapes.vocab, dtype, dev, 2048, seed=1)
    runtimes = {"target": target, "target eager": eager(target), "draft": draft,
                "draft eager": eager(draft), "target spans": spanned(target)}
    reps, warmup = cfg.curve_passes
    curves = {role: measure_forward_curve(rt, SIZES, reps=reps, warmup=warmup)
              for role, rt in runtimes.items()}
    results["curves"] = {role: c.to_dict() for role, c in curves.items()}
    t1 = curves["target"].seconds[0]
    report(f"{'tokens':>6} {'target ms':>10} {'x fwd(1)':>9} {'eager ms':>9} {'draft ms':>9} "
           f"{'eager ms':>9} {'spans ms':>9}")
    for i, n in enumerate(SIZES):
        ms = [curves[role].seconds[i] * 1e3 for role in runtimes]
        report(f"{n:6d} {ms[0]:10.2f} {ms[0] / (t1 * 1e3):9.2f} {ms[1]:9.2f} {ms[2]:9.2f} "
               f"{ms[3]:9.2f} {ms[4]:9.2f}")

    # 3. Decode speed: plain, and the target drafting for itself (acceptance 1, k tokens/step).
    results["decode"] = {}
    for label, rt in (("graphs", target), ("eager", eager(target)),
                      ("graphs, spans", spanned(target))):
        decode(rt, None, prompt, 16, 0)  # warm-up
        _, plain_s, _ = decode(rt, None, prompt, cfg.max_tokens, 0)
        out, self_s, steps = decode(rt, DraftModelProposer(rt.fork(), shapes.vocab), prompt,
                                    cfg.max_tokens, cfg.k)
        results["decode"][label] = {"max_tokens": cfg.max_tokens, "k": cfg.k,
                                    "plain_tok_s": cfg.max_tokens / plain_s,
                                    "self_draft_tok_s": len(out) / self_s,
                                    "self_draft_steps": steps}
        report(f"{label}: plain {cfg.max_tokens / plain_s:.1f} tok/s; target as its own draft, "
               f"k={cfg.k}: {len(out) / self_s:.1f} tok/s in {steps} steps")

    # 4. Head drafting cost on the device, against a one-token target pass (graphs).
    results["head_cost"] = head_costs(cfg, shapes, target, prompt, t1 * 1e3, report)
    results["head_cost"]["target_eager_fwd1_ms"] = curves["target eager"].seconds[0] * 1e3
    return results


# a chain of k; 8 nodes of a tree k deep, 2 children a node; 32 nodes, 8 deep, 4; the automatic
# budget 16 deep, 2 children (the bench's EAGLE setting): (label, nodes, depth or None = k, topk)
HEAD_SHAPES = (("chain", 0, None, 1), ("tree8", 8, None, 2), ("tree32", 32, 8, 4),
               ("auto16", AUTO_TREE, 16, 2))
GRAPH_MODES = {True: "", "levels": "-levels", False: "-eager"}


def head_costs(cfg: GpuCheckConfig, shapes: Shapes, target: TorchRuntime, prompt: list[int],
               fwd1_ms: float, report: Callable[[str], None]) -> dict:
    """Section 4: each kind, precision and (EAGLE) graph mode, each HEAD_SHAPES draft."""
    out: dict = {"target_fwd1_ms": fwd1_ms}
    report(f"head propose ms (x target fwd(1) = {fwd1_ms:.2f} ms), k={cfg.k}")
    for kind in KINDS:
        for precision in cfg.precisions:
            for graphs in (GRAPH_MODES if "eagle" in kind else (True,)):
                row: dict = {}
                for label, tree, depth, topk in HEAD_SHAPES:
                    if "eagle" not in kind and tree == AUTO_TREE:
                        continue  # Medusa and Hydra stop at their heads' depth
                    try:
                        proposer = head_proposer(kind, target, precision, tree, shapes.head,
                                                 topk, graphs)
                        row[label] = propose_cost(target, proposer, prompt, depth or cfg.k,
                                                  cfg.max_tokens // 4)["propose_ms"]
                    except Exception as e:
                        row[label] = repr(e)
                name = f"{kind}-{precision}{GRAPH_MODES[graphs]}"
                out[name] = row
                report(f"{name:24s} " + "  ".join(
                    f"{label} {v:6.2f} ms ({v / fwd1_ms:.2f}x)" if isinstance(v, float) else
                    f"{label} {v}" for label, v in row.items()))
    return out
