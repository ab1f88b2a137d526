"""`forerun bench processors`: what logits processors cost plain decoding at batch 1 (issue 42:
at most 5% per token).

Owns: the configs measured and the per-token-time ratios. On the extraction tasks, greedy,
plain decoding (no drafting) runs as:
- `plain (fast path)`: `Engine.generate` with nothing to process, which takes
  `reference.plain_decode` (one forward, one argmax a token): what a user gets, the baseline;
- `batch step`: the same decoding through `engine.speculative_decode` with no proposer, the
  batch step every processed or speculative sequence goes through, with no processors: its
  overhead over the fast path is the step's own bookkeeping, not the processors';
- `penalties + bias (engine)`: `Engine.generate` with repetition, presence and frequency
  penalties and a logit bias (PROCESSING): whichever path the engine picks for them;
- `batch step + penalties + bias`: the batch step with the same processing;
- `json_schema (engine)`: `Engine.generate` under the task's schema (a grammar mask a token).
The figure is each config's mean time per token after the first (the ITL; the prompt's
prefill is the same work in every config and would dilute the ratio), over the fast path's on
the same prompt, median over prompts; every prompt runs all configs in a shuffled order per
round, each keeping its median-wall run of `repeats`. The processed outputs differ from the
plain ones (a penalty changes tokens), which is why the ratio is per token.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from forerun.api import Engine
from forerun.bench.structured import (
    WARMUP_TOKENS,
    WORKLOAD,
    Run,
    Task,
    fitting,
    prompt_ids,
    read_tasks,
    record,
    rounds,
    sample_tasks,
)
from forerun.engine import speculative_decode
from forerun.grammar import state_for
from forerun.metrics import GenerationStats
from forerun.processors import Processing
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig, make_generator

FAST = "plain (fast path)"
STEP = "batch step"
PROC = "penalties + bias (engine)"
STEP_PROC = "batch step + penalties + bias"
SCHEMA = "json_schema (engine)"
CONFIGS = (FAST, STEP, PROC, STEP_PROC, SCHEMA)
TARGET_OVERHEAD = 0.05  # issue 42, T2: processors cost plain decoding at most 5% a token
BIASED_TOKENS = 8  # logit_bias entries, spread over the vocabulary


def processing(vocab_size: int) -> Processing:
    """Every processor on, mild (the outputs stay close to plain): penalties OpenAI clients
    send, and a small negative bias on BIASED_TOKENS ids spread over the vocabulary."""
    step = vocab_size // (BIASED_TOKENS + 1)
    return Processing.of(repetition_penalty=1.05, presence_penalty=0.1, frequency_penalty=0.1,
                         logit_bias={step * (i + 1): -1.0 for i in range(BIASED_TOKENS)})


def decode(engine: Engine, task: Task, ids: list[int], config: str, max_tokens: int
           ) -> tuple[GenerationStats, list[int], str]:
    """One greedy plain decoding of `ids` under `config` -> its stats, tokens and text."""
    vocab = engine.target.config.vocab_size
    proc = processing(vocab) if config in (PROC, STEP_PROC) else Processing()
    sampling = SamplingConfig(processing=proc,
                              grammar=task.grammar if config == SCHEMA else None)
    if config in (FAST, PROC, SCHEMA):
        c = engine.generate(ids, spec=SpecConfig("none"), sampling=sampling,
                            max_tokens=max_tokens)
        return c.stats, c.token_ids, c.text
    start = time.perf_counter()
    steps = list(speculative_decode(engine.target, None, None, ids, sampling, max_tokens,
                                    engine.tokenizer.stop_ids, make_generator(0),
                                    grammar=state_for(sampling.grammar, engine.tokenizer,
                                                      vocab)))
    tokens = [t for s in steps for t in s.tokens]
    return (GenerationStats.from_steps("none", 0, start, steps), tokens,
            engine.tokenizer.decode(tokens))


def run_processors(engine: Engine, tasks: list[Task], max_tokens: int, repeats: int = 1,
                   seed: int = 0, on_run=None) -> list[Run]:
    rng, kept = random.Random(seed), []
    for i, task in enumerate(tasks):
        ids = prompt_ids(engine, task)

        def one(config, tokens=max_tokens, task=task, ids=ids):
            run = record(task.id, config, config, len(ids),
                         *decode(engine, task, ids, config, tokens))
            if on_run is not None and tokens == max_tokens:
                on_run(run)
            return run

        if i == 0:
            for config in CONFIGS:
                one(config, WARMUP_TOKENS)
        kept += rounds(list(CONFIGS), repeats, rng, one).values()
    return kept


@dataclass(frozen=True)
class Overhead:
    config: str
    prompts: int
    itl_ms: float  # median over prompts
    tok_s: float  # median over prompts (prefill included)
    vs_fast_path: float  # median over prompts of ITL / the fast path's ITL on that prompt
    vs_batch_step: float  # the same against the batch step without processors


def aggregate(runs: list[Run]) -> list[Overhead]:
    base = {(r.task_id, r.label): r.itl_s for r in runs}
    out = []
    for config in CONFIGS:
        rs = [r for r in runs if r.label == config and r.itl_s > 0]
        if not rs:
            continue
        out.append(Overhead(
            config, len(rs), 1e3 * statistics.median(r.itl_s for r in rs),
            statistics.median(r.tok_s for r in rs),
            statistics.median(r.itl_s / base[r.task_id, FAST] for r in rs),
            statistics.median(r.itl_s / base[r.task_id, STEP] for r in rs)))
    return out


def table(rows: list[Overhead], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("config", "prompts", "ms/token", "tok/s", "vs fast path", "vs batch step"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        t.add_row(r.config, str(r.prompts), f"{r.itl_ms:.1f}", f"{r.tok_s:.2f}",
                  f"{r.vs_fast_path:.3f}", f"{r.vs_batch_step:.3f}")
    return t


def plot(path: Path, rows: list[Overhead], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    bars = ax.bar(range(len(rows)), [r.vs_fast_path for r in rows])
    ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.axhline(1 + TARGET_OVERHEAD, color="red", lw=1, ls=":", label="target: +5%")
    ax.set_xticks(range(len(rows)), [textwrap.fill(r.config, 18) for r in rows], fontsize=8)
    ax.set_ylabel("time per token / plain (fast path)")
    ax.set_ylim(0.8, max(1.2, *(r.vs_fast_path * 1.08 for r in rows)))
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, out: Path, console: Console, meta: dict, load) -> int:
    """The `forerun bench processors` command."""
    tasks = sample_tasks(read_tasks(args.workload[0] if args.workload else WORKLOAD),
                         args.limit or None, args.seed)
    with Console(stderr=True).status(f"loading {args.target}"):
        engine = Engine(args.target, None, spec=SpecConfig("none"), load=load)
    tasks = fitting(engine, tasks, args.max_tokens)
    meta = meta | {"loadavg_before": os.getloadavg()}  # other processes share the CPUs?
    with tqdm(total=len(tasks) * len(CONFIGS) * args.repeats, desc="processors", unit="run",
              file=sys.stderr) as bar:
        def tick(r: Run):
            bar.set_postfix_str(f"{r.task_id} {r.label}", refresh=False)
            bar.update()

        runs = run_processors(engine, tasks, args.max_tokens, args.repeats, args.seed, tick)
    rows = aggregate(runs)
    title = (f"forerun bench processors: {Path(str(args.target)).name} ({meta['runtime']}, "
             f"{meta['dtype']}), plain decoding at batch 1, {len(tasks)} prompts, "
             f"{args.max_tokens} new tokens, medians of {args.repeats}")
    console.print(table(rows, title))
    by = {r.config: r for r in rows}
    met = by[PROC].vs_fast_path <= 1 + TARGET_OVERHEAD
    console.print(f"T2 (penalties + bias cost plain decoding <= {TARGET_OVERHEAD:.0%} a token): "
                  f"{by[PROC].vs_fast_path - 1:+.1%} vs the fast path: "
                  f"{'met' if met else 'missed'}; the batch step alone "
                  f"{by[STEP].vs_fast_path - 1:+.1%}, processors inside it "
                  f"{by[STEP_PROC].vs_batch_step - 1:+.1%}")
    (out / "processors.json").write_text(json.dumps(
        {"meta": meta | {"loadavg_after": os.getloadavg(), "tasks": len(tasks),
                         "max_tokens": args.max_tokens,
                         "repeats": args.repeats,
                         "processing": asdict(processing(engine.target.config.vocab_size))},
         "rows": [asdict(r) for r in rows], "t2_met": met,
         "runs": [asdict(r) for r in runs]}, indent=1))
    plot(out / "processors.png", rows, title)
    console.print(f"wrote {out / 'processors.json'} and processors.png")
    print(json.dumps({"per_token_vs_fast_path": {r.config: round(r.vs_fast_path, 4)
                                                 for r in rows},
                      "t2_met": met, "results": str(out / "processors.json")}))
    return 0
