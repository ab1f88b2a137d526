"""Where speculative greedy output departs from plain greedy output, and why.

    .venv/bin/python scripts/divergence.py --dtype bfloat16 --k 4 --max-tokens 256

For each prompt of scripts/pair_report.py: run plain and speculative greedy decoding; at the first
differing token, recompute the target's logits for that position two ways, one token per forward
(the plain path) and in blocks of k+1 (the verify path), and print the top-2 tokens and the gap
between them in each. A gap of the size of the dtype's rounding means a numerical near-tie, not
a bug.
"""

from __future__ import annotations

import argparse

import torch
from pair_report import PROMPTS

from forerun import Engine, LoadConfig, SpecConfig
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


def logits_at(engine: Engine, prompt: list[int], out: list[int], i: int, block: int):
    """Logits for the token at out[i], feeding out[:i] in blocks of `block` after the prompt."""
    rt = engine.target
    rt.truncate(0)
    logits = rt.forward(torch.tensor(prompt), last_only=True).logits[-1]
    for start in range(0, i, block):
        logits = rt.forward(torch.tensor(out[start:min(i, start + block)])).logits[-1]
    return logits


def top2(logits: torch.Tensor) -> str:
    values, ids = logits.topk(2)
    gap = values[0] - values[1]
    return f"top-2 ids {ids.tolist()} logits {values[0]:.4f} {values[1]:.4f} gap {gap:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    engine = Engine(DEFAULT_TARGET, DEFAULT_DRAFT, load=LoadConfig(dtype=args.dtype, context=2048))
    diverged = 0
    for name, text in PROMPTS.items():
        ids = engine.encode(text)
        plain = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none"))
        spec = engine.generate(ids, max_tokens=args.max_tokens,
                               spec=SpecConfig(args.method, args.k))
        a, b = plain.token_ids, spec.token_ids
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if i is None:
            print(f"{name}: identical ({len(a)} tokens)")
            continue
        diverged += 1
        print(f"{name}: first difference at token {i}: plain {a[i]} vs speculative {b[i]}")
        print("   one token per pass:   " + top2(logits_at(engine, ids, a, i, 1)))
        block = logits_at(engine, ids, a, i, args.k + 1)
        print(f"   {args.k + 1} tokens per pass:   " + top2(block))
    print(f"diverged: {diverged}/{len(PROMPTS)}")


if __name__ == "__main__":
    main()
