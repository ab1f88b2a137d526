"""Accepted tokens per verify pass of multi-draft speculation on real weights, at one node
budget B: the draft model's chain of B alone, the n-gram lookup alone (B), and `multi` with B / 2
per sub-method: the draft model's chain and the n-gram's merged (recursive rejection), two
draft-model chains merged (recursive rejection), and the same two chains kept apart and verified
by SpecTr. Sampled (temperature 1) and greedy; under greedy two chains of one drafter are one
chain (the same tokens, merged) and SpecTr hands chosen drafts to recursive rejection, so only
the first three rows run there.

Usage: .venv/bin/python experiments/multi_acceptance.py [--budget 4] [--max-tokens 64]
    [--runtime torch --dtype bfloat16 | --runtime llama.cpp] [--out multi_acceptance.json]
Prompts: one per Spec-Bench category and six EditEval edits (forerun/bench/workloads, seeded;
`--prompts N` keeps N of them, both workloads alike). Prints a line per row as it is measured
(and rewrites the JSON): accepted draft tokens per verify pass (pooled over prompts:
accepted / passes), tokens per pass (that + 1), acceptance (accepted / drafted nodes), and the
ratio of accepted per pass to the best single drafter's. Public API only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from forerun import Engine, LoadConfig, SamplingConfig, SpecConfig
from forerun.bench.workloads import sample_workloads

WORKLOADS = ["spec_bench:1", "editeval:6"]  # 6 Spec-Bench categories, one each; 6 edits
SINGLE = ("draft chain", "ngram")  # the single drafters the target compares against


def configs(budget: int, greedy: bool) -> dict[str, SpecConfig]:
    """name -> SpecConfig, every one drafting at most `budget` nodes a pass."""
    half = budget // 2
    out = {
        "draft chain": SpecConfig("draft", budget),
        "ngram": SpecConfig("ngram", budget),
        "draft + ngram, merged, rrs": SpecConfig("multi", half, multi_methods=("draft", "ngram")),
    }
    if not greedy:
        out["2 draft chains, merged, rrs"] = SpecConfig("multi", half,
                                                        multi_methods=("draft", "draft"))
        out["2 draft chains apart, SpecTr"] = SpecConfig(
            "multi", half, multi_methods=("draft", "draft"), multi_verifier="spectr")
    return out


def measure(engine: Engine, prompts, spec: SpecConfig, temperature: float, seeds: int,
            max_tokens: int) -> dict:
    accepted = drafted = passes = tokens = 0
    wall = 0.0
    for i, prompt in enumerate(prompts):
        ids = engine.tokenizer.encode_chat(list(prompt.messages))
        for seed in range(seeds if temperature > 0 else 1):
            sampling = SamplingConfig(temperature=temperature, seed=1000 * seed + i)
            started = time.perf_counter()
            done = engine.generate(ids, sampling=sampling,
                                   max_tokens=max_tokens, spec=spec)
            wall += time.perf_counter() - started
            stats = done.stats
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
            passes += stats.target_forward_passes - 1  # (the prefill's pass verifies nothing)
            tokens += stats.new_tokens
    return {"accepted_per_pass": accepted / passes, "tokens_per_pass": accepted / passes + 1,
            "acceptance": accepted / max(1, drafted), "passes": passes, "tokens": tokens,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=4, help="draft nodes a pass (even)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=1, help="sampled runs per prompt")
    ap.add_argument("--prompts", type=int, default=None,
                    help="N prompts only, every (12 / N)-th: both workloads alike")
    ap.add_argument("--temperatures", default="1,0")
    ap.add_argument("--rows", default=None, help="these rows only (names, '|'-separated)")
    ap.add_argument("--runtime", default="torch")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default=None, help="default: the catalog's default pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--out", default="multi_acceptance.json")
    args = ap.parse_args()
    pair = {k: v for k, v in (("target", args.target), ("draft", args.draft)) if v}
    engine = Engine(**pair, spec=SpecConfig("draft"),
                    load=LoadConfig(args.dtype, runtime=args.runtime))
    prompts = sample_workloads(WORKLOADS, None, seed=0)
    if args.prompts:
        prompts = prompts[::max(1, len(prompts) // args.prompts)][:args.prompts]
    results = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        rows = {}
        print(f"temperature {temperature:g}, budget {args.budget} nodes, {len(prompts)} "
              f"prompts x {args.max_tokens} tokens", flush=True)
        for name, spec in configs(args.budget, temperature == 0).items():
            if args.rows and name not in args.rows.split("|"):
                continue
            rows[name] = measure(engine, prompts, spec, temperature, args.seeds, args.max_tokens)
            r = rows[name]
            write(args, prompts, {**results, f"{temperature:g}": rows})  # each row as it comes
            print(f"  {name:32s} accepted/pass {r['accepted_per_pass']:.3f}  tokens/pass "
                  f"{r['tokens_per_pass']:.3f}  acceptance {r['acceptance']:.3f}  "
                  f"({r['passes']} passes, {r['wall_s']:.0f} s)", flush=True)
        best = max((rows[n]["accepted_per_pass"] for n in SINGLE if n in rows), default=0.0)
        for r in rows.values() if best else ():
            r["vs_best_single"] = r["accepted_per_pass"] / best
        if best:
            print("  accepted/pass over the best single drafter's: " + ", ".join(
                f"{n} {r['vs_best_single']:.2f}x" for n, r in rows.items() if n not in SINGLE))
        results[f"{temperature:g}"] = rows
        write(args, prompts, results)


def write(args, prompts, results: dict) -> None:
    Path(args.out).write_text(json.dumps({"args": vars(args), "prompts": [p.id for p in prompts],
                                          "results": results}, indent=2))


if __name__ == "__main__":
    main()
