"""Check the torch runtime's CUDA path and time it, on random-initialised models of the default
pair's real shapes (Qwen2.5-Coder 1.5B target, 0.5B draft): real weights are not needed to
know what a forward pass costs, and a lent GPU machine has no network to fetch them.

What it does, on `--device` (default cuda):
1. Greedy equality: speculative output (draft model, n-gram, the target drafting for itself)
   equals plain greedy output, in float32; any divergence is printed with its top-2 logit gap.
2. The verify curve: forward time over 1..64 new tokens after 200 cached ones, target and draft,
   in `--dtype` (default bfloat16), with decode-sized passes replayed as CUDA graphs (the torch
   runtime's default on a GPU, forerun/runtime/static.py) and eager; plain decoding equal in both.
   Also the target's graphed passes attending over power-of-two spans of the cache (the
   experimental `spans=True`): its curve, its plain decoding speed, and greedy equality (plain
   with spans as without; speculative with spans as plain with spans).
3. Decode speed: plain tok/s, and speculative tok/s with the target as its own draft (every draft
   token accepted: the loop's best case, so the overhead of the machinery shows).
4. Heads on the GPU: random-initialised Medusa, Hydra, EAGLE and EAGLE-3 heads (the trained
   EAGLE head's shape) drafting chains and trees from the target's features on the device;
   greedy equality in float32 (in step 1, drafting in float32, bfloat16 and int8), and in
   `--dtype` the median ms of one `propose` (a chain of k, trees of 8 and 32 nodes, EAGLE's
   automatic budget 16 deep; Medusa and Hydra stop at their 4 heads' depth) against a
   one-token target pass: the head's drafting cost, and EAGLE's per tree level. EAGLE three
   ways: the tree grown on the device (the default), grown level by level through the host,
   and every step eager.

    python scripts/gpu_check.py --json out.json
    python scripts/gpu_check.py --device cpu --small   # a smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from forerun.engine import speculative_decode
from forerun.heads import KINDS, HeadConfig, Heads, TargetIO
from forerun.policy import FixedK
from forerun.profile import measure_forward_curve
from forerun.propose import PROPOSERS, SpecConfig
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.heads import AUTO_TREE
from forerun.propose.ngram import NgramProposer
from forerun.reference import plain_decode
from forerun.runtime.base import ModelConfig
from forerun.runtime.torch_model import TorchRuntime, Transformer
from forerun.sampling import SamplingConfig, make_generator

SHAPES = {  # the default pair (see forerun.models.catalog), read from their GGUF metadata
    "target": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960),
    "draft": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864),
}
SMALL = {"target": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
         "draft": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)}
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
VOCAB = 151_936
# the trained EAGLE head's shape (~/.cache/forerun/heads/qwen2.5-coder-1.5b-instruct/eagle)
HEAD = dict(num_heads=4, draft_vocab=16_384, n_heads=12, n_kv_heads=2, ffn_dim=2048)


def random_runtime(role: str, dtype: torch.dtype, device: str, capacity: int,
                   seed: int) -> TorchRuntime:
    """Random weights of `role`'s shape; decode-sized passes as CUDA graphs on a GPU (the
    runtime's default); `eager(rt)` is the same model without them."""
    cfg = ModelConfig(arch="qwen2", vocab_size=VOCAB, rope_theta=1e6, norm_eps=1e-6,
                      context_length=32_768, qkv_bias=True, tied_embeddings=True, **SHAPES[role])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg).to(dtype).eval()
    return TorchRuntime(model, capacity)


def decode(target, proposer, prompt, max_tokens, k) -> tuple[list[int], float, int]:
    gen, sampling = make_generator(0), SamplingConfig()
    start, steps, out = time.perf_counter(), 0, []
    loop = (plain_decode(target, prompt, sampling, max_tokens, (), gen) if proposer is None else
            speculative_decode(target, proposer, FixedK(k), prompt, sampling, max_tokens, (), gen))
    for step in loop:
        out += step.tokens
        steps += 1
    return out, time.perf_counter() - start, steps


def eager(rt: TorchRuntime) -> TorchRuntime:
    """The same weights, a cache of its own, every pass eager (no CUDA graphs)."""
    return TorchRuntime(rt.model, rt.capacity, static=False)


def spanned(rt: TorchRuntime) -> TorchRuntime:
    """The same weights, a cache of its own, graphed passes attending over power-of-two spans
    of the cache (experimental `spans=True`)."""
    return TorchRuntime(rt.model, rt.capacity, spans=True)


def random_heads(kind: str, target: TorchRuntime, precision: str, seed: int = 0) -> Heads:
    """Heads of `kind` in the trained EAGLE head's shape, random weights, on the target's
    device, drafting in `precision` (for_drafting)."""
    cfg = target.config
    n_layers = cfg.n_layers
    hc = HeadConfig(kind, cfg.dim, cfg.vocab_size,
                    layers=(1, n_layers // 2, -1) if kind == "eagle3" else (-1,),
                    **(HEAD | {"draft_vocab": min(HEAD["draft_vocab"], cfg.vocab_size)}))
    model = target.model
    io = TargetIO(model.embed.weight.detach(), model.lm_weight().detach())
    heads = Heads(hc, torch.arange(hc.draft_vocab), io, context=target.capacity)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    return heads.eval().to(target.device).for_drafting(precision)


def head_proposer(kind: str, target: TorchRuntime, precision: str, tree: int, k: int,
                  topk: int = 2, graphs: bool | str = True):
    """A head proposer as the CLI builds it; EAGLE steps replay CUDA graphs on a GPU and grow
    the tree there (the default); graphs="levels": graphed steps, but the tree grown level by
    level through the host (the code before the device tree); False: every step eager."""
    heads = random_heads(kind, target, precision)
    proposer = PROPOSERS[kind](SpecConfig(kind, k, tree=tree, tree_topk=topk), target, None,
                               heads)
    if not graphs:
        proposer.static = None
    if graphs == "levels":
        proposer.tree_on_device = False
    return proposer


def reused_eagle(target: TorchRuntime, prompt: list[int], k: int):
    """A second EAGLE proposer for the same target and heads, as a server's next request gets
    it: it takes over the first one's cache and recorded graphs, after a whole decode."""
    heads = random_heads("eagle", target, "float32")
    spec = SpecConfig("eagle", k, tree=8, tree_topk=2)
    first = PROPOSERS["eagle"](spec, target, None, heads)
    decode(target, first, prompt, 64, k)
    proposer = PROPOSERS["eagle"](spec, target, None, heads)
    assert proposer.k_cache is first.k_cache and proposer.static is first.static
    return proposer


def first_divergence(target, prompt, a, b) -> dict | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            target.truncate(0)
            logits = target.forward(torch.tensor(prompt + a[:i]), last_only=True).logits[-1]
            top = logits.topk(2).values
            return {"position": i, "top2_gap": float(top[0] - top[1])}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--precisions", default="bfloat16,int8",
                    help="head drafting precisions to time, comma-separated")
    ap.add_argument("--small", action="store_true", help="tiny shapes (to try the script)")
    args = ap.parse_args()
    if args.small:
        global VOCAB
        SHAPES.update(SMALL)
        HEAD.update(n_heads=4, ffn_dim=48)
        VOCAB = 512
    dev, dtype = args.device, getattr(torch, args.dtype)
    prompt = [int(t) for t in torch.randint(VOCAB - 1, (200,), generator=make_generator(1))]
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                     "torch": torch.__version__, "dtype": args.dtype}

    # 1. Equality in float32 (random weights give small logit gaps: bf16 would tie too often).
    t32 = random_runtime("target", torch.float32, dev, 1024, seed=0)
    d32 = random_runtime("draft", torch.float32, dev, 1024, seed=1)
    ref, _, _ = decode(t32, None, prompt, 64, 0)
    ref_eager, _, _ = decode(eager(t32), None, prompt, 64, 0)
    same = ref_eager == ref
    results["graphs_equal_eager_plain"] = {"identical": same, "divergence": first_divergence(
        eager(t32), prompt, ref_eager, ref)}
    print(f"greedy plain fp32, graphs vs eager: "
          f"{'identical' if same else results['graphs_equal_eager_plain']}")
    # attention over spans of the cache (experimental): plain output as without, and lossless
    s32 = spanned(t32)
    ref_spans, _, _ = decode(s32, None, prompt, 64, 0)
    results["spans_equal_plain"] = {"identical": ref_spans == ref, "divergence":
                                    first_divergence(t32, prompt, ref, ref_spans)}
    print(f"greedy plain fp32, spans vs whole cache: "
          f"{'identical' if ref_spans == ref else results['spans_equal_plain']}")
    for name, proposer in (("self", DraftModelProposer(s32.fork(), VOCAB)),
                           ("eagle-tree8", head_proposer("eagle", s32, "float32", 8, args.k))):
        out, _, _ = decode(s32, proposer, prompt, 64, args.k)
        div = first_divergence(s32, prompt, ref_spans, out)
        results[f"spans_equality_{name}"] = {"identical": out == ref_spans, "divergence": div}
        print(f"greedy equality fp32 spans {name}: {'identical' if out == ref_spans else div}")
    del s32
    checks = {"draft": (DraftModelProposer, d32, VOCAB), "ngram": (NgramProposer, 1, 4),
              "self": (DraftModelProposer, t32.fork(), VOCAB)}
    for kind in KINDS:  # heads on the device: trees of 8 nodes, EAGLE also a chain and auto
        checks[f"{kind}-tree8"] = (head_proposer, kind, t32, "float32", 8, args.k)
    checks["eagle-chain"] = (head_proposer, "eagle", t32, "float32", 0, args.k)
    checks["eagle-auto"] = (head_proposer, "eagle", t32, "float32", AUTO_TREE, args.k)
    for precision in ("bfloat16", "int8"):  # drafts may change, the output may not
        checks[f"eagle-tree8-{precision}"] = (head_proposer, "eagle", t32, precision, 8, args.k)
    checks["eagle-tree8-eager"] = (head_proposer, "eagle", t32, "float32", 8, args.k, 2, False)
    checks["eagle-tree8-levels"] = (head_proposer, "eagle", t32, "float32", 8, args.k, 2,
                                    "levels")
    checks["eagle3-auto16"] = (head_proposer, "eagle3", t32, "float32", AUTO_TREE, 16)
    checks["eagle-tree8-reused"] = (reused_eagle, t32, prompt, args.k)
    results["equality"] = {}
    for name, (make, *make_args) in checks.items():
        try:
            proposer = make(*make_args)
        except Exception as e:  # e.g. a kernel this torch build lacks on the device
            results["equality"][name] = {"error": repr(e)}
            print(f"greedy equality fp32 {name:6s}: cannot run: {e!r}")
            continue
        out, _, _ = decode(t32, proposer, prompt, 64, args.k)
        div = first_divergence(t32, prompt, ref, out)
        results["equality"][name] = {"identical": out == ref, "divergence": div}
        print(f"greedy equality fp32 {name:6s}: {'identical' if out == ref else div}")
    del t32, d32, checks
    torch.cuda.empty_cache() if dev == "cuda" else None

    # 2. Verify curves in the timing dtype, CUDA graphs (the default) and eager.
    target = random_runtime("target", dtype, dev, 2048, seed=0)
    draft = random_runtime("draft", dtype, dev, 2048, seed=1)
    runtimes = {"target": target, "target eager": eager(target), "draft": draft,
                "draft eager": eager(draft), "target spans": spanned(target)}
    curves = {role: measure_forward_curve(rt, SIZES, reps=20, warmup=3)
              for role, rt in runtimes.items()}
    results["curves"] = {role: c.to_dict() for role, c in curves.items()}
    t1 = curves["target"].seconds[0]
    print(f"{'tokens':>6} {'target ms':>10} {'x fwd(1)':>9} {'eager ms':>9} {'draft ms':>9} "
          f"{'eager ms':>9} {'spans ms':>9}")
    for i, n in enumerate(SIZES):
        ms = [curves[role].seconds[i] * 1e3 for role in runtimes]
        print(f"{n:6d} {ms[0]:10.2f} {ms[0] / (t1 * 1e3):9.2f} {ms[1]:9.2f} {ms[2]:9.2f} "
              f"{ms[3]:9.2f} {ms[4]:9.2f}")

    # 3. Decode speed: plain, and the target drafting for itself (acceptance 1, k tokens/step).
    results["decode"] = {}
    for label, rt in (("graphs", target), ("eager", eager(target)),
                      ("graphs, spans", spanned(target))):
        decode(rt, None, prompt, 16, 0)  # warm-up
        _, plain_s, _ = decode(rt, None, prompt, args.max_tokens, 0)
        out, self_s, steps = decode(rt, DraftModelProposer(rt.fork(), VOCAB), prompt,
                                    args.max_tokens, args.k)
        results["decode"][label] = {"max_tokens": args.max_tokens, "k": args.k,
                                    "plain_tok_s": args.max_tokens / plain_s,
                                    "self_draft_tok_s": len(out) / self_s,
                                    "self_draft_steps": steps}
        print(f"{label}: plain {args.max_tokens / plain_s:.1f} tok/s; target as its own draft, "
              f"k={args.k}: {len(out) / self_s:.1f} tok/s in {steps} steps")

    # 4. Head drafting cost on the device, against a one-token target pass (graphs).
    fwd1 = curves["target"].seconds[0] * 1e3
    results["head_cost"] = {"target_fwd1_ms": fwd1,
                            "target_eager_fwd1_ms": curves["target eager"].seconds[0] * 1e3}
    print(f"head propose ms (x target fwd(1) = {fwd1:.2f} ms), k={args.k}")
    # EAGLE: the tree grown on the device, level by level through the host, every step eager
    rows = [(kd, p, g) for kd in KINDS for p in args.precisions.split(",")
            for g in ((True, "levels", False) if "eagle" in kd else (True,))]
    # a chain of k; 8 nodes of a tree k deep, 2 children a node; 32 nodes, 8 deep, 4; the
    # automatic budget 16 deep, 2 children (the bench's EAGLE setting)
    shapes = (("chain", 0, args.k, 1), ("tree8", 8, args.k, 2), ("tree32", 32, 8, 4),
              ("auto16", AUTO_TREE, 16, 2))
    for kind, precision, graphs in rows:
        row = {}
        for label, tree, k, topk in shapes:
            if "eagle" not in kind and label == "auto16":
                continue
            try:
                row[label] = propose_ms(head_proposer(kind, target, precision, tree, k, topk,
                                                      graphs), target, prompt, k)
            except Exception as e:
                row[label] = repr(e)
        name = f"{kind}-{precision}" + {True: "", "levels": "-levels", False: "-eager"}[graphs]
        results["head_cost"][name] = row
        print(f"{name:24s} " + "  ".join(
            f"{label} {v:6.2f} ms ({v / fwd1:.2f}x)" if isinstance(v, float) else
            f"{label} {v}" for label, v in row.items()))
    # per draft step: a propose's ms over the levels it drafts (Medusa's heads: one step)
    depth = {label: k for label, _, k, _ in shapes}
    for name, row in list(results["head_cost"].items()):
        if isinstance(row, dict) and "eagle" in name:
            per = {label: v / depth[label] / fwd1 for label, v in row.items()
                   if isinstance(v, float)}
            results["head_cost"][name + "/per_level_x"] = per
            print(f"{name:24s} per level: " + "  ".join(f"{label} {v:.3f}x"
                                                          for label, v in per.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def propose_ms(proposer, target: TorchRuntime, prompt: list[int], k: int, reps: int = 15) -> float:
    """Median ms of one decode step's drafting: one new feature taken in, then a draft."""
    greedy, gen = SamplingConfig(temperature=0), make_generator(0)
    target.truncate(0)
    hidden = target.forward(torch.tensor(prompt[:-1]), last_only=True,
                            hidden_layers=proposer.hidden_layers).hidden  # [P-1, D] a layer
    proposer.prefill(prompt[:-1])  # the cached prompt; prompt[-1] is the pending token
    proposer.feed(hidden)
    proposer.propose(prompt, k, greedy, gen)  # takes the prompt's features in
    times = []
    for _ in range(reps):
        # as if the last token had just been accepted (the cache starts at `first`)
        proposer.committed = len(prompt) - 2 - proposer.first
        proposer.skip = 0  # an automatic budget may rest after a draft it cut to nothing
        proposer.feed({i: h[-1:] for i, h in hidden.items()})
        start = time.perf_counter()
        proposer.propose(prompt, k, greedy, gen)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
