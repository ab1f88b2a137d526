"""Measure the reduced draft vocabulary lever (FR-Spec): the draft's forward time and, side by
side on the same prompts, plain decoding vs draft-model speculation with the full vocabulary and
with the N most frequent tokens only.

    python scripts/draft_vocab.py --sizes 32768,16384 --workload editeval:3 --workload spec_bench:1
"""

from __future__ import annotations

import argparse
import json
import statistics

from forerun import Engine, LoadConfig, SamplingConfig, SpecConfig
from forerun.bench.workloads import sample_workloads
from forerun.profile import measure_forward_curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="32768,16384")
    ap.add_argument("--workload", action="append", default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = Engine(spec=SpecConfig("draft", args.k), load=LoadConfig(dtype=args.dtype))
    engines = {"full": engine}
    for n in sizes:
        draft = engine.draft.fork()  # same weights, a head of its own
        draft.limit_vocab(engine.tokenizer.frequent_ids(n))
        engines[f"top {n}"] = Engine.from_runtimes(engine.target, engine.tokenizer, draft,
                                                   engine.spec)
    fwd = {name: measure_forward_curve(e.draft, (1,), reps=15).seconds[0] * 1e3
           for name, e in engines.items()}
    prompts = sample_workloads(args.workload or ["editeval:3", "spec_bench:1"], 0, seed=0)
    rows: dict[str, list] = {"plain": [], **{name: [] for name in engines}}
    for p in prompts:
        ids = engine.tokenizer.encode_prompt(p.text)
        engine.generate(ids, max_tokens=4, spec=SpecConfig("none"))  # warm-up
        plain = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none"))
        rows["plain"].append((plain.stats.tokens_per_s, 1.0, True))
        for name, e in engines.items():
            out = e.generate(ids, max_tokens=args.max_tokens, sampling=SamplingConfig())
            rows[name].append((out.stats.tokens_per_s, out.stats.mean_accepted_length,
                               out.token_ids == plain.token_ids))
    result = {"draft_forward_ms": fwd, "prompts": len(prompts), "rows": {}}
    base = [r[0] for r in rows["plain"]]
    print(f"{'':10s} {'draft fwd(1) ms':>16s} {'tok/s':>7s} {'speedup':>8s} {'acc len':>8s} "
          f"{'identical':>9s}")
    for name, rs in rows.items():
        speed = statistics.median(r[0] / b for r, b in zip(rs, base, strict=True))
        row = {"tok_s": statistics.median(r[0] for r in rs), "speedup_median": speed,
               "mean_accepted_length": statistics.mean(r[1] for r in rs),
               "identical": sum(r[2] for r in rs) / len(rs)}
        result["rows"][name] = row
        print(f"{name:10s} {fwd.get(name, float('nan')):16.1f} {row['tok_s']:7.2f} "
              f"{speed:8.2f} {row['mean_accepted_length']:8.2f} {row['identical']:9.0%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
