"""The `--disaggregate` drafter as a Ray actor placed by a placement group against the same
drafter as a local worker process, on the same prompt, cores and models, in one process.

Greedy, `--max-tokens` new tokens of one EditEval prompt, the llama.cpp runtime; the target in
this process pinned to the first core (1 thread), the drafter pinned to the last (1 thread):
  plain 1          plain decoding, the target alone on its core (identity's reference)
  async process    the pipeline, its drafter a `DrafterProcess` (a multiprocessing pipe)
  async ray        the pipeline, its drafter a `RayDrafter` (forerun.cluster.drafter_actor):
                   a Ray actor in bundle 1 of a PACK placement group {CPU: 1}, {CPU: 1} on a
                   local 2-CPU Ray cluster started here
Ray's cluster is up for every cell (its own processes idle on the same cores either way). After
an untimed warm-up round (the prompt's last WARMUP_PROMPT tokens), `--rounds` rounds, the two
pipeline cells in alternating order; each cell's median tok/s (new tokens over wall, prefill
included) and whether every output equals plain's.

    flock /tmp/forerun-bench.lock .venv/bin/python experiments/drafter_ray_bench.py \
        --rounds 3 --max-tokens 64 --json out/drafter_ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from forerun.bench.workloads import sample_workloads
from forerun.cluster.drafter_actor import join_cluster, start_ray_drafter
from forerun.engine import speculative_decode
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from forerun.models.load import open_model
from forerun.policy import FixedK
from forerun.propose.disaggregate import AsyncDraftProposer, DisaggregateConfig, DraftRecipe
from forerun.propose.drafter_worker import DrafterProcess, pin
from forerun.reference import plain_decode
from forerun.runtime.llama_cpp import LlamaCppRuntime
from forerun.sampling import SamplingConfig, make_generator

CAPACITY = 4096
WARMUP_PROMPT = 32  # the untimed first round's prompt: the prompt's last tokens
ASYNC_K, WAIT_S = 8, 0.2  # the most a pipeline pass verifies; its wait for a first node


def run(label: str, steps_of, ids: list[int]) -> dict:
    started = time.perf_counter()
    steps = list(steps_of(ids))
    wall = time.perf_counter() - started
    tokens = [t for s in steps for t in s.tokens]
    return {"config": label, "tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall,
            "passes": len(steps), "drafted": sum(s.drafted for s in steps),
            "accepted": sum(s.accepted for s in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--prompt", type=int, default=0, help="which of the seeded EditEval sample")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    target_core, draft_core = (cores[0],), (cores[-1],)
    prompt = sample_workloads([f"editeval:{args.prompt + 1}"], None, 0)[args.prompt]
    src = open_model(args.target)
    ids = src.tokenizer.encode_chat(list(prompt.messages))
    greedy, stop = SamplingConfig(), src.tokenizer.stop_ids
    cfg = DisaggregateConfig(draft_core, target_core, wait_s=WAIT_S)
    recipe = DraftRecipe(args.draft, context=CAPACITY, runtime="llama.cpp")
    vocab = src.config.vocab_size
    join_cluster(None, len(cores))  # a local cluster: both cells run beside its processes
    process = DrafterProcess(recipe, vocab, draft_core)
    actor, _ = start_ray_drafter(recipe, vocab, cfg, "PACK", set(cores))
    pin(target_core)
    target = LlamaCppRuntime(src.path, src.config, CAPACITY, n_threads=1)

    def plain(ids):
        return plain_decode(target, ids, greedy, args.max_tokens, stop, make_generator(0))

    def pipeline(worker):
        proposer = AsyncDraftProposer(worker, cfg)
        return lambda ids: speculative_decode(target, proposer, FixedK(ASYNC_K), ids, greedy,
                                              args.max_tokens, stop, make_generator(0))

    rows: list[dict] = []
    try:
        for n in range(args.rounds + 1):  # the first round warms up, untimed
            prompt_ids = ids[-WARMUP_PROMPT:] if n == 0 else ids
            cells = [("async process", process), ("async ray", actor)]
            round_ = [run("plain 1", plain, prompt_ids)] + [
                run(label, pipeline(worker), prompt_ids)
                for label, worker in (cells if n % 2 else cells[::-1])]
            if n == 0:
                continue
            for r in round_:
                r["round"], r["identical"] = n, r["tokens"] == round_[0]["tokens"]
                print(f"{prompt.id} round {n} {r['config']:>13}: {r['tok_s']:6.2f} tok/s, "
                      f"{r['accepted']}/{r['drafted']} accepted in {r['passes']} passes, "
                      f"identical {r['identical']}", flush=True)
            rows += round_
    finally:
        process.close()
        actor.close()
    summary = {}
    for label in ("plain 1", "async process", "async ray"):
        mine = [r for r in rows if r["config"] == label]
        summary[label] = {"median_tok_s": statistics.median(r["tok_s"] for r in mine),
                          "identical": all(r["identical"] for r in mine)}
    print(json.dumps(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"prompt": prompt.id, "cores": cores,
                                               "summary": summary, "runs": rows}))


if __name__ == "__main__":
    main()
