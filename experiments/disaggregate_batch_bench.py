"""`--disaggregate` for a batch: one drafter worker on its own core drafting for every member,
against the same batch drafted in process on both cores, and plain batched decoding.

EditEval prompts (the bench's seeded sample) decoded together with `Engine.generate_batch`,
greedy, `--max-tokens` new tokens each, llama.cpp runtime, default pair. Cells, each in a fresh
process (pinning and llama.cpp's thread count are per process, fixed when a model loads):
  plain 2       plain batched decoding, the target on both cores (2 threads)
  draft 2 k=K   the batch's shared draft model in process (one draft pass per position for
                every member), both models on both cores
  apart 1+1 k=K the draft model in a worker process pinned to the last core drafting ahead for
                every member (its pool: one draft pass for all), the target pinned to the first;
                a pass takes up to K ready nodes a member, waiting at most WAIT in all
Each cell runs an untimed warm-up batch (the same prompts, WARMUP_TOKENS new tokens) first.
tok/s is every member's new tokens over the timed batch's wall time (prefill included). Each
cell's outputs are compared with plain's, token for token.

    flock /tmp/forerun-bench.lock .venv/bin/python experiments/disaggregate_batch_bench.py \
        --prompts 4 --max-tokens 64 --cells plain,draft,apart --json out/disagg_batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WARMUP_TOKENS = 4
KV_BUDGET = 256 << 20  # bytes per model: 4 EditEval prompts and their outputs, with room


def run_cell(args) -> dict:
    """One cell in this process -> its figures and every member's tokens."""
    from forerun import Engine, LoadConfig, SpecConfig
    from forerun.bench.workloads import sample_workloads
    from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    cores = sorted(os.sched_getaffinity(0))
    spec = {"plain": SpecConfig("none"),
            "draft": SpecConfig("draft", args.k, "fixed"),
            "apart": SpecConfig("draft", args.k, "fixed", disaggregate=True,
                                draft_cores=(cores[-1],), target_cores=(cores[0],),
                                disaggregate_wait=args.wait)}[args.cell]
    engine = Engine(DEFAULT_TARGET, None if args.cell == "plain" else DEFAULT_DRAFT, spec=spec,
                    load=LoadConfig(runtime="llama.cpp"))
    prompts = [engine.tokenizer.encode_chat(list(p.messages))
               for p in sample_workloads([f"editeval:{args.prompts}"], None, args.seed)]
    engine.generate_batch(prompts, max_tokens=WARMUP_TOKENS, kv_budget_bytes=KV_BUDGET)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    out = engine.generate_batch(prompts, max_tokens=args.max_tokens, kv_budget_bytes=KV_BUDGET)
    wall = time.perf_counter() - started
    engine.close()
    tokens = sum(c.stats.new_tokens for c in out)
    label = {"plain": "plain 2", "draft": f"draft 2 k={args.k}",
             "apart": f"apart 1+1 k={args.k} wait={args.wait:g}"}[args.cell]
    return {"cell": label, "wall_s": wall, "new_tokens": tokens, "tok_s": tokens / wall,
            "prompt_tokens": [len(p) for p in prompts], "load_before": load,
            "passes": sum(c.stats.target_forward_passes for c in out),
            "drafted": sum(c.stats.drafted for c in out),
            "accepted": sum(c.stats.accepted for c in out),
            "token_ids": [c.token_ids for c in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="EditEval prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft length (apart: the most a pass takes)")
    ap.add_argument("--wait", type=float, default=0.2, help="apart: --disaggregate-wait")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cells", default="plain,draft,apart")
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # a child's one cell
    ap.add_argument("--json", default=None, metavar="FILE", help="rows appended here")
    args = ap.parse_args()
    if args.cell is not None:
        print(json.dumps(run_cell(args)))
        return
    path = Path(args.json) if args.json else None
    rows = json.loads(path.read_text()) if path is not None and path.exists() else []
    for cell in args.cells.split(","):
        child = subprocess.run([sys.executable, __file__, "--cell", cell, "--prompts",
                                str(args.prompts), "--max-tokens", str(args.max_tokens), "--k",
                                str(args.k), "--wait", str(args.wait), "--seed", str(args.seed)],
                               capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"cell {cell} failed:\n{child.stderr[-3000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"{rows[-1]['cell']}: {rows[-1]['tok_s']:.2f} tok/s", flush=True)
        if path is not None:
            path.write_text(json.dumps(rows, indent=1))
    plain = next((r["token_ids"] for r in rows if r["cell"] == "plain 2"), None)
    print("| cell | tok/s | wall s | passes | drafted | accepted | identical to plain | load |")
    print("|---|--:|--:|--:|--:|--:|---|--:|")
    for r in rows:
        same = "-" if plain is None else str(r["token_ids"] == plain)
        print(f"| {r['cell']} | {r['tok_s']:.2f} | {r['wall_s']:.1f} | {r['passes']} | "
              f"{r['drafted']} | {r['accepted']} | {same} | {r['load_before']:.2f} |")


if __name__ == "__main__":
    main()
