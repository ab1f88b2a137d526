"""Speed report for one model pair: plain vs `draft` and `ngram` speculation at several k, on five
code prompts (two of them edits), greedy; plus the target's forward time over 1..16 new tokens.

    .venv/bin/python scripts/pair_report.py --dtype bfloat16 --ks 2,4,6 --json out/pair.json

Every figure is measured in this process, plain and speculative side by side on the same loaded
models. Prints a table per prompt and a summary; writes JSON with every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from forerun import Engine, LoadConfig, SpecConfig
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

EDIT_CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            parts = line.strip().split(",")
            if len(parts) != 3:
                continue
            users.append({"name": parts[0], "email": parts[1], "age": int(parts[2])})
    return users


def adults(users):
    result = []
    for u in users:
        if u["age"] >= 18:
            result.append(u)
    return result
'''
PROMPTS = {
    "write-lru": "Write a Python class LRUCache with get and put methods in O(1), with type hints.",
    "write-parser": "Write a Python function that parses an INI file into a dict of dicts "
                    "without using configparser.",
    "explain-sql": "Write a SQL query that returns the top 3 customers by total order value per "
                   "country, with a short explanation.",
    "edit-dataclass": "Refactor this code to use a dataclass User instead of dicts. "
                      "Return the whole file.\n\n" + EDIT_CODE,
    "edit-rename": "Rename `users` to `people` and `u` to `person` everywhere in this code and "
                   "add docstrings. Return the whole file.\n\n" + EDIT_CODE,
}
FORWARD_SIZES = (1, 2, 4, 8, 16)
FORWARD_CONTEXT = 200


def forward_curve(engine: Engine, repeats: int = 5) -> dict[int, float]:
    rt = engine.target
    rt.truncate(0)
    rt.forward(torch.randint(0, 1000, (FORWARD_CONTEXT,)), last_only=True)
    curve = {}
    for size in FORWARD_SIZES:
        times = []
        for _ in range(repeats):
            rt.truncate(FORWARD_CONTEXT)
            start = time.perf_counter()
            rt.forward(torch.randint(0, 1000, (size,)))
            times.append(time.perf_counter() - start)
        curve[size] = statistics.median(times) * 1000
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ks", default="2,4,6", help="comma-separated draft lengths")
    ap.add_argument("--methods", default="draft,ngram")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    console = Console(stderr=True, width=140)

    engine = Engine(args.target, args.draft, load=LoadConfig(dtype=args.dtype, context=2048))
    curve = forward_curve(engine)
    console.print("target forward ms by new tokens (context 200): " +
                  ", ".join(f"{k}: {v:.0f}" for k, v in curve.items()))
    specs = [SpecConfig("none", 0)] + [SpecConfig(m, int(k)) for m in args.methods.split(",")
                                    for k in args.ks.split(",")]
    engine.generate("warm up", max_tokens=4, spec=specs[1])
    runs = []
    for name in args.prompts.split(","):
        plain = None
        for spec in specs:
            out = engine.generate(PROMPTS[name], max_tokens=args.max_tokens, spec=spec)
            plain = plain or out
            runs.append({"prompt": name, "method": spec.method, "k": spec.k,
                         "tokens_per_s": out.stats.tokens_per_s,
                         "speedup": out.stats.tokens_per_s / plain.stats.tokens_per_s,
                         "mean_accepted_length": out.stats.mean_accepted_length,
                         "acceptance_rate": out.stats.acceptance_rate,
                         "new_tokens": out.stats.new_tokens,
                         "identical": out.token_ids == plain.token_ids})
            r = runs[-1]
            console.print(f"{name:15s} {spec.method:5s} k={spec.k} {r['tokens_per_s']:6.2f} tok/s "
                          f"x{r['speedup']:.2f} mal={r['mean_accepted_length']:.2f} "
                          f"identical={r['identical']} tokens={r['new_tokens']}")

    table = Table(title=f"{args.target} + {args.draft}, {args.dtype}, greedy, "
                        f"{args.max_tokens} new tokens max")
    for col in ("method", "k", "tok/s (median)", "speedup (median)", "speedup edits",
                "mean acc. len", "identical"):
        table.add_column(col, justify="right")
    for spec in specs:
        rows = [r for r in runs if r["method"] == spec.method and r["k"] == spec.k]
        edits = [r["speedup"] for r in rows if r["prompt"].startswith("edit")]
        table.add_row(spec.method, str(spec.k),
                      f"{statistics.median(r['tokens_per_s'] for r in rows):.2f}",
                      f"{statistics.median(r['speedup'] for r in rows):.2f}",
                      f"{statistics.median(edits):.2f}" if edits else "-",
                      f"{statistics.mean(r['mean_accepted_length'] for r in rows):.2f}",
                      f"{sum(r['identical'] for r in rows)}/{len(rows)}")
    Console(width=140).print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"dtype": args.dtype, "forward_ms": curve,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
