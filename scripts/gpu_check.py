"""Check the torch runtime's CUDA path and time it, on random-initialised models of the default
pair's real shapes (Qwen2.5-Coder 1.5B target, 0.5B draft): real weights are not needed to
know what a forward pass costs, and a lent GPU machine has no network to fetch them.

What it does, on `--device` (default cuda):
1. Greedy equality: speculative output (draft model, n-gram, the target drafting for itself)
   equals plain greedy output, in float32; any divergence is printed with its top-2 logit gap.
2. The verify curve: forward time over 1..32 new tokens after 200 cached ones, target and draft,
   in `--dtype` (default bfloat16).
3. Decode speed: plain tok/s, and speculative tok/s with the target as its own draft (every draft
   token accepted: the loop's best case, so the overhead of the machinery shows).

    python scripts/gpu_check.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from forerun.engine import speculative_decode
from forerun.policy import FixedK
from forerun.profile import measure_forward_curve
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.ngram import NgramProposer
from forerun.reference import plain_decode
from forerun.runtime.base import ModelConfig
from forerun.runtime.torch_model import TorchRuntime, Transformer
from forerun.sampling import SamplingConfig, make_generator

SHAPES = {  # the default pair (see forerun.models.catalog), read from their GGUF metadata
    "target": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_dim=8960),
    "draft": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864),
}
SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def random_runtime(role: str, dtype: torch.dtype, device: str, capacity: int,
                   seed: int) -> TorchRuntime:
    cfg = ModelConfig(arch="qwen2", vocab_size=151_936, rope_theta=1e6, norm_eps=1e-6,
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
    args = ap.parse_args()
    dev, dtype = args.device, getattr(torch, args.dtype)
    prompt = [int(t) for t in torch.randint(151_000, (200,), generator=make_generator(1))]
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                     "torch": torch.__version__, "dtype": args.dtype}

    # 1. Equality in float32 (random weights give small logit gaps: bf16 would tie too often).
    t32 = random_runtime("target", torch.float32, dev, 1024, seed=0)
    d32 = random_runtime("draft", torch.float32, dev, 1024, seed=1)
    ref, _, _ = decode(t32, None, prompt, 64, 0)
    checks = {"draft": DraftModelProposer(d32, 151_936), "ngram": NgramProposer(1, 4),
              "self": DraftModelProposer(t32.fork(), 151_936)}
    results["equality"] = {}
    for name, proposer in checks.items():
        out, _, _ = decode(t32, proposer, prompt, 64, args.k)
        div = first_divergence(t32, prompt, ref, out)
        results["equality"][name] = {"identical": out == ref, "divergence": div}
        print(f"greedy equality fp32 {name:6s}: {'identical' if out == ref else div}")
    del t32, d32, checks
    torch.cuda.empty_cache() if dev == "cuda" else None

    # 2. Verify curves in the timing dtype.
    target = random_runtime("target", dtype, dev, 2048, seed=0)
    draft = random_runtime("draft", dtype, dev, 2048, seed=1)
    curves = {role: measure_forward_curve(rt, SIZES, reps=20, warmup=3)
              for role, rt in (("target", target), ("draft", draft))}
    results["curves"] = {role: c.to_dict() for role, c in curves.items()}
    t1 = curves["target"].seconds[0]
    print(f"{'tokens':>6} {'target ms':>10} {'x fwd(1)':>9} {'draft ms':>9}")
    for i, n in enumerate(SIZES):
        tms, dms = curves["target"].seconds[i] * 1e3, curves["draft"].seconds[i] * 1e3
        print(f"{n:6d} {tms:10.2f} {tms / (t1 * 1e3):9.2f} {dms:9.2f}")

    # 3. Decode speed: plain, and the target drafting for itself (acceptance 1, k tokens/step).
    decode(target, None, prompt, 16, 0)  # warm-up
    _, plain_s, _ = decode(target, None, prompt, args.max_tokens, 0)
    out, self_s, steps = decode(target, DraftModelProposer(target.fork(), 151_936), prompt,
                                args.max_tokens, args.k)
    results["decode"] = {"max_tokens": args.max_tokens, "k": args.k,
                         "plain_tok_s": args.max_tokens / plain_s,
                         "self_draft_tok_s": len(out) / self_s, "self_draft_steps": steps}
    print(f"plain {args.max_tokens / plain_s:.1f} tok/s; target as its own draft, k={args.k}: "
          f"{len(out) / self_s:.1f} tok/s in {steps} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
