"""Heads' agreement with the target on benchmark replies, per category: the held-out figure
`forerun train` reports, measured where the bench will draft instead of on the training corpus.

Plain greedy replies to benchmark prompts (generated here, or read from a `--record` file
written before), each prompt + reply teacher-forced through the llama.cpp target (its last
`--window` tokens, as a training window), then `forerun.train.predictions`, the training
code's own path, per head folder given: top-1 agreement with the target's argmax per rolled-out
step, on the reply's rows (by category) and on the prompt's rows. Chain-of-one acceptance on
those replies is the step-1 reply figure. Deterministic: two heads compared here differ by
their drafts alone, not by a noisy machine's timing.

    python experiments/bench_agreement.py --heads DIR --heads DIR2 \\
        --workload spec_bench:4 --workload editeval:4 --record /tmp/replies.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from forerun.api import Engine, LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.heads import load_heads
from forerun.models.load import open_model, target_io
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig
from forerun.train import TrainConfig, predictions, teacher, vocab_lookup


def replies(engine: Engine, workloads: list[str], seed: int, max_tokens: int,
            path: Path) -> list[dict]:
    """{category, prompt, out} per prompt: read from `path`, else generated and written there."""
    if path.exists():
        return [json.loads(line) for line in path.read_text().splitlines()]
    rows = []
    for p in sample_workloads(workloads, None, seed):
        ids = engine.encode(p.text)
        out = engine.generate(ids, max_tokens=max_tokens,
                              sampling=SamplingConfig(temperature=0)).token_ids
        rows.append({"id": p.id, "category": p.category, "prompt": ids, "out": out})
        print(f"[{len(rows)}] {p.category} {p.id}: {len(ids)} + {len(out)} tokens", flush=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", action="append", required=True, help="a head folder (repeatable)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--workload", action="append", default=None,
                    help="NAME[:N] as in forerun bench (default: spec_bench:4, editeval:4)")
    ap.add_argument("--seed", type=int, default=7, help="prompt sample")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--window", type=int, default=256, help="tokens teacher-forced per prompt")
    ap.add_argument("--record", type=Path, default=Path("bench_replies.jsonl"),
                    help="replies: read if it exists, else generated and written here")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(runtime="llama.cpp"))
    rows = replies(engine, args.workload or ["spec_bench:4", "editeval:4"], args.seed,
                   args.max_tokens, args.record)
    windows = []  # (category, first reply-predicting teacher row, shard)
    for r in rows:
        ids = r["prompt"] + r["out"]
        start = max(0, len(ids) - args.window)
        windows.append((r["category"], len(r["prompt"]) - start,
                        teacher(engine.target, ids[start:], (-1,))))
    io = target_io(open_model(args.target), engine.target)
    result = {}
    for folder in args.heads:
        heads = load_heads(folder, io).eval()
        cfg = TrainConfig(**heads.cfg.training["config"])
        lookup = vocab_lookup(heads)
        counts: dict[str, list[list[int]]] = defaultdict(list)  # part -> per step [hits, rows]
        with torch.no_grad():
            for category, first, w in windows:
                preds, _ = predictions(heads, w, cfg)
                for step, (logits, rows_) in enumerate(preds):
                    teach = torch.arange(rows_.start, rows_.stop)  # [R] the teacher's rows
                    best = lookup[w["top_ids"][rows_, 0].long()]  # [R]; -1: outside its vocab
                    hit = logits.argmax(-1) == best  # [R]
                    # teacher row t holds the target's choice of token t + 1: a reply's token
                    # from row `first` on (the reply's first token comes from the prefill)
                    for part, m in ((category, teach >= first), ("all replies", teach >= first),
                                    ("all prompts", teach < first)):
                        while len(counts[part]) <= step:
                            counts[part].append([0, 0])
                        counts[part][step][0] += int(hit[m].sum())
                        counts[part][step][1] += int(m.sum())
        result[folder] = {part: {"top1": [round(h / max(1, n), 3) for h, n in steps],
                                 "rows": steps[0][1]} for part, steps in counts.items()}
    if args.json:
        print(json.dumps(result))
        return
    for folder, parts in result.items():
        print(folder)
        for part, r in parts.items():
            print(f"  {part:16s} top-1 {' / '.join(f'{x:.3f}' for x in r['top1'])}  "
                  f"({r['rows']} rows)")


if __name__ == "__main__":
    main()
