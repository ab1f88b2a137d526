"""The asynchronous draft/target pipeline (`--disaggregate`) against the synchronous draft loop,
in one process, on the same EditEval prompts, the same draft model and the same cores.

For each prompt, in a round, greedy, `--max-tokens` new tokens:
  plain 2         plain decoding, the target on both cores (2 threads)
  sync 2          the draft loop (draft k tokens, then verify), both models on 2 threads
  sync 1+1        the draft loop, each model on 1 thread (the cores split, taking turns)
  async 1+1       the pipeline: the drafter in a worker process pinned to the last core, the
                  target in this process pinned to the first, 1 thread each; a pass takes what
                  is drafted (up to `--async-k`), waiting at most WAIT for a first token; with
                  LOOKUP, each draft-model pass also checks that many prompt-lookup guesses
                  (`--pipelines`)
A run's tok/s is new tokens over wall time (prefill included); `decode tok/s` leaves the first
token out. The target's idle share is 1 - (its passes' seconds) / wall, from a timed subclass
of the runtime; for the pipeline also the seconds it waited for a first draft token, and the
draft tokens it verified that were drafted while it verified the pass before. Whether each
output equals plain's is printed beside. Before the rounds: one-token pass times of each model
on 1 and 2 threads after CONTEXT cached tokens (median of REPS).

    flock /tmp/forerun-bench.lock .venv/bin/python experiments/async_pipeline_bench.py \
        --prompts 4 --max-tokens 64 --json out/async_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from forerun.bench.workloads import sample_workloads
from forerun.engine import speculative_decode
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from forerun.models.load import open_model
from forerun.policy import FixedK
from forerun.propose.base import Draft
from forerun.propose.disaggregate import AsyncDraftProposer, DisaggregateConfig, DraftRecipe
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.drafter_worker import LOOKUP_MAX_N, LOOKUP_MIN_N, DrafterProcess, pin
from forerun.propose.ngram import SuffixIndex
from forerun.reference import plain_decode
from forerun.runtime.llama_cpp import LlamaCppRuntime
from forerun.sampling import SamplingConfig, make_generator

CONTEXT, REPS = 200, 15  # the one-token pass timings: cached tokens, repetitions
CAPACITY = 4096
WARMUP_PROMPT = 32  # the untimed first round's prompt: the first prompt's last tokens


class TimedLlama(LlamaCppRuntime):
    """A llama.cpp runtime that adds up the seconds its passes take."""

    busy = 0.0

    def forward(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.busy += time.perf_counter() - started


class LookupDraft(DraftModelProposer):
    """The synchronous loop's draft model with the pipeline's `--disaggregate-lookup` (greedy):
    each draft pass also checks `lookup` prompt-lookup guesses and drafts every one its argmax
    agrees with. For a like-for-like row beside the pipeline's lookup cells."""

    def __init__(self, runtime: LlamaCppRuntime, vocab: int, lookup: int):
        super().__init__(runtime, vocab)
        self.lookup, self.index = lookup, SuffixIndex(LOOKUP_MIN_N, LOOKUP_MAX_N)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        line, drafted = list(tokens), []
        while len(drafted) < k:
            guesses = self.index.match(line, min(self.lookup, k - len(drafted) - 1))[0]
            feed = torch.tensor(line[self.runtime.length:] + guesses)  # [M + G]
            rows = self.runtime.forward(feed, last_only=not guesses).logits[-len(guesses) - 1:]
            made = []
            for j in range(len(guesses) + 1):
                made.append(int(self._to_target_vocab(rows[j]).argmax()))  # rows: [G+1, V]
                if j == len(guesses) or guesses[j] != made[-1]:
                    break
            if guesses:  # the cache keeps the guesses the argmax agreed with
                self.runtime.truncate(len(line) + len(made) - 1)
            line += made
            drafted += made
        return Draft(torch.tensor(drafted[:k], dtype=torch.long)) if k else Draft.empty()


def runtime(source: str, threads: int) -> TimedLlama:
    src = open_model(source)
    return TimedLlama(src.path, src.config, CAPACITY, n_threads=threads)


def pass_ms(rt: LlamaCppRuntime) -> float:
    """Median one-token pass after CONTEXT cached tokens, ms."""
    rt.truncate(0)
    rt.forward(torch.arange(CONTEXT) % 1000 + 100, last_only=True)
    times = []
    for _ in range(REPS):
        started = time.perf_counter()
        rt.forward(torch.tensor([7]), last_only=True)
        times.append(time.perf_counter() - started)
        rt.truncate(CONTEXT)
    return statistics.median(times) * 1000


def run(label: str, target: TimedLlama, steps_of, ids: list[int]) -> dict:
    """One request: `steps_of(ids)` its Steps; timed, with the target's busy seconds."""
    target.busy = 0.0
    started = time.perf_counter()
    steps = list(steps_of(ids))
    wall = time.perf_counter() - started
    tokens = [t for s in steps for t in s.tokens]
    first = steps[0].time - started if steps else wall
    drafted = sum(s.drafted for s in steps)
    return {"config": label, "tokens": tokens, "new_tokens": len(tokens), "wall_s": wall,
            "tok_s": len(tokens) / wall, "decode_tok_s": (len(tokens) - 1) / max(wall - first,
                                                                              1e-9),
            "target_busy_s": target.busy, "target_idle": 1 - target.busy / wall,
            "passes": len(steps), "drafted": drafted, "accepted": sum(s.accepted for s in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--prompts", type=int, default=4, help="EditEval prompts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="4", help="the synchronous loop's draft lengths, a cell each")
    ap.add_argument("--async-k", type=int, default=8, help="the most a pipeline pass verifies")
    ap.add_argument("--ahead", type=int, default=16, help="the most the worker drafts ahead")
    ap.add_argument("--pipelines", default="0.2:0,0:0,0.2:8", metavar="WAIT:LOOKUP,...",
                    help="pipeline cells: the most a pass waits for a first draft token "
                    "before it runs plain (seconds), and the lookup guesses a draft pass "
                    "checks (0: one token a draft pass)")
    ap.add_argument("--sync-lookup", type=int, default=8, metavar="N",
                    help="also the synchronous 1+1 loop with N lookup guesses a draft pass "
                    "(as the pipeline's lookup cells; 0: not)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores")
    target_core, draft_core = (cores[0],), (cores[-1],)
    tokenizer = open_model(args.target).tokenizer
    prompts = sample_workloads([f"editeval:{args.prompts}"], None, args.seed)
    greedy, stop = SamplingConfig(), tokenizer.stop_ids
    target2, target1 = runtime(args.target, 2), runtime(args.target, 1)
    draft2, draft1 = runtime(args.draft, 2), runtime(args.draft, 1)
    costs = {"target_2t_ms": pass_ms(target2), "target_1t_ms": pass_ms(target1),
             "draft_2t_ms": pass_ms(draft2), "draft_1t_ms": pass_ms(draft1)}
    print("one-token pass after", CONTEXT, "tokens:",
          ", ".join(f"{k} {v:.1f}" for k, v in costs.items()), flush=True)
    vocab = target1.config.vocab_size
    worker = DrafterProcess(DraftRecipe(args.draft, context=CAPACITY, runtime="llama.cpp"),
                            vocab, draft_core)  # llama.cpp: one thread a pinned core
    ks = [int(k) for k in args.ks.split(",")]
    pipelines = [(float(w), int(n)) for w, n in (c.split(":") for c in args.pipelines.split(","))]

    def plain(ids):
        return plain_decode(target2, ids, greedy, args.max_tokens, stop, make_generator(0))

    def sync(target, draft, k, lookup=0):
        def steps(ids):
            proposer = (LookupDraft(draft, vocab, lookup) if lookup else
                        DraftModelProposer(draft, vocab))
            return speculative_decode(target, proposer, FixedK(k), ids, greedy,
                                      args.max_tokens, stop, make_generator(0))
        return steps

    rows: list[dict] = []
    try:
        for n, prompt in enumerate([prompts[0], *prompts]):  # the first round warms up, untimed
            ids = tokenizer.encode_chat(list(prompt.messages))
            if n == 0:
                ids = ids[-WARMUP_PROMPT:]
            round_ = [run("plain 2", target2, plain, ids)]
            for k in ks:
                round_.append(run(f"sync 2 k={k}", target2, sync(target2, draft2, k), ids))
                round_.append(run(f"sync 1+1 k={k}", target1, sync(target1, draft1, k), ids))
                if args.sync_lookup:
                    round_.append(run(f"sync 1+1 k={k} lookup={args.sync_lookup}", target1,
                                      sync(target1, draft1, k, args.sync_lookup), ids))
            for wait, lookup in pipelines:
                cfg = DisaggregateConfig(draft_core, target_core, wait_s=wait, ahead=args.ahead,
                                         lookup=lookup)
                proposer = AsyncDraftProposer(worker, cfg)
                pin(target_core)  # the target's process on its core while the pipeline runs
                try:
                    label = f"async 1+1 wait={wait:g}" + (f" lookup={lookup}" if lookup else "")
                    asy = run(label, target1, lambda ids, p=proposer:
                              speculative_decode(target1, p, FixedK(args.async_k), ids, greedy,
                                                 args.max_tokens, stop, make_generator(0)), ids)
                finally:
                    os.sched_setaffinity(0, cores)
                    torch.set_num_threads(len(cores))
                asy |= {"waited_s": proposer.waited_s, "empty_passes": proposer.empty,
                        "ahead_used": proposer.ahead_used, "failure": proposer.failure}
                round_.append(asy)
            for r in round_:
                r["prompt"], r["identical"] = prompt.id, r["tokens"] == round_[0]["tokens"]
                print(f"{prompt.id:>12} {r['config']:>18}: {r['tok_s']:6.2f} tok/s, decode "
                      f"{r['decode_tok_s']:6.2f}, idle {r['target_idle']:.2f}, passes "
                      f"{r['passes']}, drafted {r['drafted']}, accepted {r['accepted']}, "
                      f"identical {r['identical']}", flush=True)
            if n:
                rows.extend(round_)
                write(args.json, {"args": vars(args), "costs": costs, "runs": rows})
    finally:
        worker.close()
    summary = summarize(rows)
    for name, s in summary.items():
        print(f"{name:>18}: {s['tok_s']:6.2f} tok/s (decode {s['decode_tok_s']:6.2f}), "
              f"x plain {s['vs_plain']:.2f}, x best sync 1+1 {s['vs_best_sync_1_1']:.2f}, "
              f"x best sync 2 {s['vs_best_sync_2']:.2f}, target idle {s['target_idle']:.3f}, "
              f"identical {s['identical']}/{s['runs']}")
    write(args.json, {"args": vars(args), "costs": costs, "summary": summary, "runs": rows})


def write(path: str | None, report: dict) -> None:
    """The report as JSON at `path` (after every round: a run cut short keeps its rounds)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))


def summarize(rows: list[dict]) -> dict:
    """Per config: total new tokens over total wall (and decode), ratios, idle, identity."""
    out = {}
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        wall = sum(r["wall_s"] for r in mine)
        busy = sum(r["target_busy_s"] for r in mine)
        first = sum(r["wall_s"] - (r["new_tokens"] - 1) / r["decode_tok_s"] for r in mine)
        tokens = sum(r["new_tokens"] for r in mine)
        out[name] = {"tok_s": tokens / wall, "decode_tok_s": (tokens - len(mine)) / (wall - first),
                     "target_idle": 1 - busy / wall, "runs": len(mine),
                     "identical": sum(r["identical"] for r in mine),
                     "passes": sum(r["passes"] for r in mine),
                     "drafted": sum(r["drafted"] for r in mine),
                     "accepted": sum(r["accepted"] for r in mine)}
        if "waited_s" in mine[0]:  # the pipeline's own figures
            out[name] |= {"waited_share": sum(r["waited_s"] for r in mine) / wall,
                          "empty_passes": sum(r["empty_passes"] for r in mine),
                          "ahead_used": sum(r["ahead_used"] for r in mine)}
    def best(prefix: str) -> float:
        return max((s["tok_s"] for n, s in out.items() if n.startswith(prefix)), default=1e-9)

    for s in out.values():
        s["vs_plain"] = s["tok_s"] / out["plain 2"]["tok_s"]
        s["vs_best_sync_1_1"] = s["tok_s"] / best("sync 1+1")  # (lookup cells included)
        s["vs_best_sync_2"] = s["tok_s"] / best("sync 2 ")
    return out


if __name__ == "__main__":
    main()
