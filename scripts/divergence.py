"""Where speculative greedy output departs from plain greedy output, and why.

    .venv/bin/python scripts/divergence.py --dtype bfloat16 --k 4 --max-tokens 256
    .venv/bin/python scripts/divergence.py --runtime llama.cpp --methods draft,ngram \\
        --max-tokens 128 --timings

For each prompt of scripts/pair_report.py and each method: run plain and speculative greedy
decoding on the same runtime; at the first differing token, recompute the target's logits for
that position two ways, one token per forward (the plain path) and in blocks of k+1 (the verify
path), and print the top-2 tokens and the gap between them in each. A gap of the size of the
runtime's rounding means a numerical near-tie, not a bug. Also prints plain and speculative
tokens/s, and with --timings the target's forward time by new tokens and the draft's forward(1).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from pair_report import FORWARD_CONTEXT, FORWARD_SIZES, PROMPTS

from forerun import Engine, LoadConfig, SpecConfig
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from forerun.models.load import RUNTIMES

TIMING_REPEATS = 5


def logits_at(engine: Engine, prompt: list[int], out: list[int], i: int, block: int):
    """Logits for the token at out[i], feeding out[:i] in blocks of `block` after the prompt."""
    rt = engine.target
    rt.truncate(0)
    logits = rt.forward(torch.tensor(prompt), last_only=True).logits[-1]
    for start in range(0, i, block):
        logits = rt.forward(torch.tensor(out[start:min(i, start + block)])).logits[-1]
    return logits


def top2(logits: torch.Tensor) -> tuple[str, float]:
    values, ids = logits.topk(2)
    gap = float(values[0] - values[1])
    return f"top-2 ids {ids.tolist()} logits {values[0]:.4f} {values[1]:.4f} gap {gap:.4f}", gap


def forward_ms(rt, size: int, context: int = FORWARD_CONTEXT) -> float:
    """Median time of one forward over `size` new tokens after `context` cached ones."""
    rt.truncate(0)
    rt.forward(torch.randint(0, 1000, (context,)), last_only=True)
    times = []
    for _ in range(TIMING_REPEATS + 1):  # the first pass is a warm-up
        rt.truncate(context)
        start = time.perf_counter()
        rt.forward(torch.randint(0, 1000, (size,)))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1000


def print_timings(engine: Engine, runtime: str) -> None:
    curve = {size: forward_ms(engine.target, size) for size in FORWARD_SIZES}
    print(f"{runtime} target forward ms at context {FORWARD_CONTEXT} (median of "
          f"{TIMING_REPEATS}): " + ", ".join(f"{k}: {v:.1f}" for k, v in curve.items()))
    if engine.draft is not None:
        print(f"{runtime} draft forward(1) ms: {forward_ms(engine.draft, 1):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", default="torch", choices=list(RUNTIMES))
    ap.add_argument("--dtype", default="bfloat16", help="torch runtime only")
    ap.add_argument("--methods", default="draft", help="comma-separated: draft, ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--timings", action="store_true", help="also time forward passes")
    args = ap.parse_args()
    engine = Engine(DEFAULT_TARGET, DEFAULT_DRAFT,
                    load=LoadConfig(dtype=args.dtype, context=2048, runtime=args.runtime))
    if args.timings:
        print_timings(engine, args.runtime)
    methods = args.methods.split(",")
    for method in methods:  # first calls pay one-off costs: keep them out of the tok/s figures
        engine.generate("warm up", max_tokens=4, spec=SpecConfig(method, args.k))
    diverged, gaps, speedups = dict.fromkeys(methods, 0), [], {m: [] for m in methods}
    names = args.prompts.split(",")
    for name in names:
        ids = engine.encode(PROMPTS[name])
        plain = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none"))
        print(f"{name}: plain {plain.stats.tokens_per_s:.2f} tok/s ({len(plain.token_ids)} tokens)")
        for method in methods:
            spec = engine.generate(ids, max_tokens=args.max_tokens,
                                   spec=SpecConfig(method, args.k))
            speedups[method].append(spec.stats.tokens_per_s / plain.stats.tokens_per_s)
            a, b = plain.token_ids, spec.token_ids
            i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            print(f"   {method} k={args.k}: {spec.stats.tokens_per_s:.2f} tok/s "
                  f"x{speedups[method][-1]:.2f}, mean accepted length "
                  f"{spec.stats.mean_accepted_length:.2f}, " +
                  ("identical" if i is None else f"first difference at token {i}: "
                   f"plain {a[i]} vs speculative {b[i]}"))
            if i is None:
                continue
            diverged[method] += 1
            line, gap = top2(logits_at(engine, ids, a, i, 1))
            gaps.append(gap)
            print("      one token per pass:   " + line)
            print(f"      {args.k + 1} tokens per pass:   " +
                  top2(logits_at(engine, ids, a, i, args.k + 1))[0])
    for method in methods:
        print(f"{method} k={args.k}: diverged {diverged[method]}/{len(names)}, speedup median "
              f"x{statistics.median(speedups[method]):.2f} "
              f"({min(speedups[method]):.2f}-{max(speedups[method]):.2f})")
    if gaps:
        print("top-2 gaps (plain path) at the first differences: " +
              ", ".join(f"{g:.4f}" for g in sorted(gaps)))


if __name__ == "__main__":
    main()
