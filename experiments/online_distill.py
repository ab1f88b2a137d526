"""Online distillation on real weights: a domain stream through the server's worker, with and
without the background trainer (`forerun serve --online-distill`).

A Medusa head (new: identity blocks, learning from zero, unless --heads) drafts for the target
while one kind of request streams in (the first N EditEval edits, or one Spec-Bench
category), `--concurrent` at a time. Run once without the trainer (the head as loaded), then
with it: acceptance per quarter of the stream (in arrival order), p50 inter-token latency,
the trainer's updates and compute seconds. Both runs share one process and one target; each
reply is checked against the first run's (the output never changes). Writes JSON.

    flock /tmp/forerun-bench.lock python experiments/online_distill.py --requests 48 \
        --out /tmp/online_distill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from itertools import pairwise
from pathlib import Path

import torch

from forerun import Engine, LoadConfig, SpecConfig
from forerun.api import DEFAULT_TARGET
from forerun.bench.workloads import read_workload
from forerun.models.load import open_model, target_io
from forerun.sampling import SamplingConfig
from forerun.serve.worker import Delta, Done, Failed, Job, Worker
from forerun.train.online import OnlineConfig, OnlineDistiller, serving_distiller


def stream(engine: Engine, prompts: list[str], worker: Worker, max_tokens: int,
           concurrent: int) -> list[dict]:
    """Every prompt through the worker, `concurrent` in flight, in order -> per request: its
    token ids, drafted, accepted, and its inter-token gaps (a step's gap shared by its
    tokens, as the server's histogram counts them)."""
    out: list[dict] = [{} for _ in prompts]
    slots = threading.Semaphore(concurrent)
    done = threading.Semaphore(0)

    def emit_for(i: int):
        rec = out[i] = {"ids": [], "gaps": [], "times": [], "drafted": 0, "accepted": 0}

        def emit(event) -> None:
            if isinstance(event, Delta):
                rec["ids"] += event.token_ids
                rec["gaps"] += [lp.top[0][1] - lp.top[1][1] for lp in event.step.logprobs or ()]
                if event.token_ids:
                    rec["times"].append((event.step.time, len(event.token_ids)))
                rec["drafted"], rec["accepted"] = (event.stats["drafted"],
                                                   event.stats["accepted"])
            elif isinstance(event, Done | Failed):
                rec["failed"] = isinstance(event, Failed)
                slots.release()
                done.release()
        return emit

    worker.start()
    try:
        for i, text in enumerate(prompts):
            slots.acquire()
            worker.submit([Job(engine.tokenizer.encode_prompt(text), SamplingConfig(),
                               max_tokens, (), engine.spec, emit=emit_for(i),
                               logprobs=2)])  # the top-2 gap where runs part
        for _ in prompts:
            done.acquire()
    finally:
        worker.stop()
    for rec in out:
        times = rec.pop("times")
        rec["itl"] = [(b - a) / n for (a, _), (b, n) in pairwise(times)
                      for _ in range(n)]
    return out


def parting(a: dict, b: dict) -> dict:
    """The first position where two replies differ, and each run's top-2 gap (nats) there."""
    at = next(i for i, (x, y) in enumerate(zip(a["ids"] + [-1], b["ids"] + [-2], strict=False))
              if x != y)
    gap = [round(r["gaps"][at], 4) if at < len(r["gaps"]) else None for r in (a, b)]
    return {"position": at, "gap_first_run": gap[0], "gap_this_run": gap[1]}


def summary(recs: list[dict]) -> dict:
    q = len(recs) // 4
    quarters = [recs[i * q:(i + 1) * q] for i in range(4)]
    rate = [sum(r["accepted"] for r in part) / max(1, sum(r["drafted"] for r in part))
            for part in quarters]
    itl = [g for r in recs for g in r["itl"]]
    return {"acceptance_by_quarter": [round(x, 4) for x in rate],
            "last_over_first": round(rate[3] / rate[0], 3) if rate[0] else None,
            "p50_itl_ms": round(1000 * statistics.median(itl), 2) if itl else None,
            "tokens": sum(len(r["ids"]) for r in recs),
            "failed": sum(r.get("failed", False) for r in recs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--workload", default="/work/shared/workloads/editeval/edit_eval.jsonl")
    p.add_argument("--category", default=None, help="only this category's prompts")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrent", type=int, default=4)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--heads", default=None, help="start from these heads (default: a new one)")
    p.add_argument("--every", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--share", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", default="plain-head,trainer")
    p.add_argument("--out", type=Path, default=Path("online_distill.json"))
    args = p.parse_args()

    prompts = [pr.text for pr in read_workload(args.workload)
               if args.category is None or pr.category == args.category][:args.requests]
    spec = SpecConfig("medusa", args.k)
    engine = Engine(args.target, None, spec=spec,
                    load=LoadConfig(heads=args.heads, head_precision="float32"))
    name = Path(str(args.target)).name.removesuffix(".gguf")
    cfg = OnlineConfig(args.every, args.steps, lr=args.lr, share=args.share,
                       threads=args.threads)
    # the head both runs start from (a new one: identity blocks), set to draft
    serving_distiller(engine, cfg, target_io(open_model(args.target), engine.target), name, 4,
                      16384)
    initial = {k: v.clone() for k, v in engine.heads.blocks.state_dict().items()}
    report = {"target": name, "workload": args.workload, "category": args.category,
              "requests": len(prompts), "max_tokens": args.max_tokens,
              "concurrent": args.concurrent, "k": args.k, "heads": args.heads or "new",
              "online": vars(cfg), "torch_threads": torch.get_num_threads(), "runs": {}}
    first = None
    for mode in args.modes.split(","):
        with torch.no_grad():  # every run starts from the same head
            engine.heads.blocks.load_state_dict(initial)
        worker = Worker(engine, slots=args.concurrent, max_queue=args.concurrent,
                        spec_policy="always",
                        distiller=OnlineDistiller(engine.heads, cfg, name)
                        if mode == "trainer" else None)
        started = time.perf_counter()
        recs = stream(engine, prompts, worker, args.max_tokens, args.concurrent)
        run = summary(recs) | {"wall_s": round(time.perf_counter() - started, 1)}
        if worker.distiller is not None:
            d = worker.distiller
            run |= {"updates": d.updates, "live_version": d.live_version,
                    "positions": d.buffer.added, "train_s": round(d.train_seconds, 1),
                    "trainer_bytes": d.nbytes}
        ids = [r["ids"] for r in recs]
        if first is not None:  # where a reply parts from the first run's: both runs' top-2
            # log-probability gaps there (bf16 passes of other shapes round differently)
            run["same_output_as_first_run"] = ids == [r["ids"] for r in first]
            run["parted"] = [parting(a, b) for a, b in zip(first, recs, strict=True)
                             if a["ids"] != b["ids"]]
        first = first or recs
        report["runs"][mode] = run
        print(mode, json.dumps(run), flush=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
