"""`forerun bench structured`: speculative decoding under a JSON schema against the same
prompts unconstrained (issue 42: the schema speedup must reach the free one).

Owns: the JSON-extraction tasks (`Task`: chat messages, a JSON schema, the expected object;
`read_tasks` reads the built-in PyPI-metadata set or any JSONL of that shape), the run loop
(every prompt in both modes, free and under its schema, each through plain decoding and every
speculative cell, side by side in one process and in a seeded shuffled order per round, each
config keeping its median-wall run over `repeats` rounds), scoring an output (valid JSON for the
schema, fields right against the expected object), the aggregation into `Cell`s and the table,
JSON and plot. Every speedup is speculative over plain decoding *in the same mode*: free over
free, schema over schema (plain decoding under a grammar runs through the batch step, which
masks the logits). `forerun bench processors` (T2) lives in `processor_cost.py` and reuses the
tasks and the round loop. Never tokenizes by hand: the engine's chat template does.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import textwrap
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from forerun.api import Engine
from forerun.bench.workloads import DATA_DIR, WorkloadError
from forerun.grammar import Grammar
from forerun.metrics import GenerationStats
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig

WORKLOAD = DATA_DIR / "pypi_metadata" / "extract.jsonl"
MODES = ("free", "schema")  # unconstrained, and under the task's json_schema grammar
PLAIN = "plain"
WARMUP_TOKENS = 4  # one short untimed run per config first: one-off costs stay out
SCORED_FIELDS = ("name", "version", "requires_python", "dependencies")  # `license` is fuzzy


@dataclass(frozen=True)
class Task:
    id: str
    messages: tuple[dict, ...]  # the chat's first turn
    schema: dict  # the JSON schema of the answer
    expected: dict | None = None  # the object the prompt implies, where known

    @property
    def grammar(self) -> Grammar:
        return Grammar("json_schema", json.dumps(self.schema))


def read_tasks(path: str | Path = WORKLOAD) -> list[Task]:
    """Every task of a JSONL file whose rows have `prompt` (or `messages`) and `schema`."""
    path, tasks = Path(path), []
    if not path.is_file():
        raise WorkloadError(f"structured workload {path}: no such file")
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        row = json.loads(raw)
        if "schema" not in row or not ("prompt" in row or "messages" in row):
            raise WorkloadError(f"{path}:{n}: a structured task needs 'schema' and 'prompt' "
                                f"(or 'messages'); got keys {sorted(row)}")
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        tasks.append(Task(str(row.get("id", n)), tuple(messages), row["schema"],
                          row.get("expected")))
    if not tasks:
        raise WorkloadError(f"{path}: no tasks")
    return tasks


def prompt_ids(engine: Engine, task: Task) -> list[int]:
    """The task's chat through the model's template (its contents as they are without one)."""
    tok = engine.tokenizer
    if tok.chat_template is None:
        return tok.encode("\n\n".join(m["content"] for m in task.messages))
    return tok.encode_chat(list(task.messages))


def sample_tasks(tasks: list[Task], limit: int | None, seed: int) -> list[Task]:
    """A seeded sample of `limit` tasks (all for None), in file order."""
    if limit is None or limit >= len(tasks):
        return tasks
    keep = set(random.Random(f"{seed}:structured").sample(range(len(tasks)), limit))
    return [t for i, t in enumerate(tasks) if i in keep]


@dataclass
class Run:
    task_id: str
    mode: str  # "free" / "schema" (structured) or the processing config (processors)
    label: str  # PLAIN or "draft k=4" ...
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    ttft_s: float
    itl_s: float  # mean gap per token after the first
    verify_steps: int  # target passes after the prefill
    drafted: int
    accepted: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    valid: bool = False  # the whole text is JSON that conforms to the schema
    valid_fenced: bool = False  # the same after taking off a ``` fence around it
    fields_right: float | None = None  # share of SCORED_FIELDS equal to the expected ones
    identical: bool | None = None  # token for token the plain run of its mode (spec runs)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def record(task_id: str, mode: str, label: str, prompt_tokens: int, stats: GenerationStats,
           token_ids: list[int], text: str) -> Run:
    return Run(task_id, mode, label, prompt_tokens, stats.new_tokens, stats.wall_s,
               stats.ttft_s, stats.itl_s, max(0, stats.target_forward_passes - 1),
               stats.drafted, stats.accepted, text, token_ids)


def rounds(configs: list[Hashable], repeats: int, rng: random.Random,
           run_one: Callable[[Hashable], Run]) -> dict[Hashable, Run]:
    """Run every config `repeats` times, each round in its own shuffled order (a slow drift of
    the machine hits all alike) -> each config's run of median wall time."""
    runs: dict[Hashable, list[Run]] = {c: [] for c in configs}
    for _ in range(repeats):
        order = list(configs)
        rng.shuffle(order)
        for c in order:
            runs[c].append(run_one(c))
    return {c: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for c, rs in runs.items()}


def conforms(value, schema: dict) -> bool:
    """`value` against the JSON-schema subset the workload uses: type (one or a list),
    properties, required, additionalProperties: false, items."""
    kinds = schema.get("type")
    if kinds is not None and not any(_is(value, k) for k in
                                     ([kinds] if isinstance(kinds, str) else kinds)):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", ())):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    if isinstance(value, list) and "items" in schema:
        return all(conforms(v, schema["items"]) for v in value)
    return True


def _is(value, kind: str) -> bool:
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, {"string": str, "array": list, "object": dict, "boolean": bool,
                              "null": type(None), "integer": int,
                              "number": (int, float)}[kind])


def parse(text: str, fenced: bool = False):
    """The JSON value of `text` (with `fenced`, after taking off a ```json fence), or None."""
    text = text.strip()
    if fenced and text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def score(run: Run, task: Task) -> Run:
    """Fill in the run's validity and, where the task knows its answer, the fields right."""
    strict, loose = parse(run.text), parse(run.text, fenced=True)
    run.valid = strict is not None and conforms(strict, task.schema)
    run.valid_fenced = loose is not None and conforms(loose, task.schema)
    if task.expected is not None:
        got = loose if isinstance(loose, dict) else {}  # a missing key is a wrong field
        run.fields_right = sum(f in got and _norm(got[f]) == _norm(task.expected.get(f))
                               for f in SCORED_FIELDS) / len(SCORED_FIELDS)
    return run


def _norm(value):
    """Package names compare as PEP 503 normalizes them; other values as they are."""
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, str):
        return value.strip().lower().replace("_", "-").replace(".", "-")
    return value


def run_structured(engine: Engine, tasks: list[Task], cells: list[tuple[str, SpecConfig]],
                   max_tokens: int, repeats: int = 1, seed: int = 0,
                   on_run: Callable[[Run], None] | None = None) -> list[Run]:
    """Every task in both MODES, plain and each (label, spec) cell, greedy -> the kept runs."""
    configs = [(mode, label) for mode in MODES for label in [PLAIN, *(c[0] for c in cells)]]
    specs = {PLAIN: SpecConfig("none"), **dict(cells)}
    rng, kept = random.Random(seed), []
    for i, task in enumerate(tasks):
        ids = prompt_ids(engine, task)
        sampling = {"free": SamplingConfig(), "schema": SamplingConfig(grammar=task.grammar)}

        def one(config, tokens=max_tokens, task=task, ids=ids, sampling=sampling):
            mode, label = config
            c = engine.generate(ids, spec=specs[label], sampling=sampling[mode],
                                max_tokens=tokens)
            run = score(record(task.id, mode, label, len(ids), c.stats, c.token_ids, c.text),
                        task)
            if on_run is not None and tokens == max_tokens:
                on_run(run)
            return run

        if i == 0:  # warm-up: the grammar engine's tokenizer, first passes of each size
            for config in configs:
                one(config, WARMUP_TOKENS)
        by_config = rounds(configs, repeats, rng, one)
        for (mode, label), run in by_config.items():
            if label != PLAIN:
                run.identical = run.token_ids == by_config[mode, PLAIN].token_ids
            kept.append(run)
    return kept


@dataclass(frozen=True)
class Cell:
    mode: str
    label: str
    prompts: int
    tok_s: float  # median over prompts
    speedup: float  # median over prompts of tok/s over the plain run of the same mode
    decode_speedup: float  # the same for the time per token after the first (no prefill)
    acceptance: float  # accepted / drafted, pooled over prompts
    accepted_per_pass: float  # tokens per verify pass (accepted + 1), pooled
    drafted_per_pass: float  # draft tokens verified per pass, pooled (the grammar cuts drafts)
    valid: float  # share of outputs that are JSON conforming to the schema, as they are
    valid_fenced: float  # the same once a ``` fence is taken off
    fields_right: float | None  # mean share of the scored fields equal to the expected ones
    identical: float | None  # share token for token equal to plain decoding (spec cells)


def aggregate(runs: list[Run]) -> list[Cell]:
    plain = {(r.task_id, r.mode): r for r in runs if r.label == PLAIN}
    groups: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.mode, r.label), []).append(r)
    cells = []
    for (mode, label), rs in groups.items():
        passes, drafted = sum(r.verify_steps for r in rs), sum(r.drafted for r in rs)
        right = [r.fields_right for r in rs if r.fields_right is not None]
        same = [r.identical for r in rs if r.identical is not None]
        cells.append(Cell(
            mode, label, len(rs), statistics.median(r.tok_s for r in rs),
            statistics.median(r.tok_s / plain[r.task_id, mode].tok_s for r in rs),
            statistics.median(plain[r.task_id, mode].itl_s / r.itl_s if r.itl_s else 0.0
                              for r in rs),
            sum(r.accepted for r in rs) / drafted if drafted else 0.0,
            (sum(r.accepted for r in rs) + passes) / passes if passes else 0.0,
            drafted / passes if passes else 0.0,
            sum(r.valid for r in rs) / len(rs), sum(r.valid_fenced for r in rs) / len(rs),
            statistics.mean(right) if right else None,
            sum(same) / len(same) if same else None))
    return cells


def comparison(cells: list[Cell]) -> dict[str, dict]:
    """Per speculative cell: the free and schema speedups, their ratio and T1's verdict."""
    by = {(c.mode, c.label): c for c in cells}
    out = {}
    for (mode, label), c in by.items():
        if mode == "schema" and label != PLAIN and ("free", label) in by:
            free = by["free", label]
            ratio = c.speedup / free.speedup if free.speedup else 0.0
            out[label] = {"free_speedup": free.speedup, "schema_speedup": c.speedup,
                          "schema_over_free": ratio, "t1_met": ratio >= 1.0,
                          "free_decode_speedup": free.decode_speedup,
                          "schema_decode_speedup": c.decode_speedup,
                          "decode_schema_over_free": c.decode_speedup / free.decode_speedup
                          if free.decode_speedup else 0.0,
                          "accepted_per_pass": {"free": free.accepted_per_pass,
                                                "schema": c.accepted_per_pass},
                          "acceptance": {"free": free.acceptance, "schema": c.acceptance}}
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(cells: list[Cell], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    # decode: the speedup after the first token; unfenced: valid once a ``` fence is taken off
    for col in ("mode", "config", "prompts", "tok/s", "speedup", "decode", "acceptance",
                "tok/pass", "drafted/pass", "valid JSON", "unfenced", "fields right", "= plain"):
        t.add_column(col, justify="left" if col in ("mode", "config") else "right")
    for c in cells:
        spec = c.label != PLAIN
        t.add_row(c.mode, c.label, str(c.prompts), f"{c.tok_s:.2f}", f"{c.speedup:.2f}x",
                  f"{c.decode_speedup:.2f}x",
                  _pct(c.acceptance) if spec else "-",
                  f"{c.accepted_per_pass:.2f}", f"{c.drafted_per_pass:.2f}" if spec else "-",
                  _pct(c.valid), _pct(c.valid_fenced), _pct(c.fields_right),
                  _pct(c.identical))
    return t


def plot(path: Path, cells: list[Cell], title: str) -> None:
    """Speedup and accepted tokens per pass of each speculative cell, free beside schema."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(c.label for c in cells if c.label != PLAIN))
    by = {(c.mode, c.label): c for c in cells}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(MODES)
    for ax, what, name in ((axes[0], lambda c: c.speedup, "speedup vs plain of the same mode"),
                           (axes[1], lambda c: c.accepted_per_pass, "tokens per verify pass")):
        for j, mode in enumerate(MODES):
            xs = [i + (j - (len(MODES) - 1) / 2) * width for i in range(len(labels))]
            vals = [what(by[mode, lb]) if (mode, lb) in by else 0.0 for lb in labels]
            bars = ax.bar(xs, vals, width, label=mode)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
            if what == "speedup":  # the decode speedup (after the first token) as a tick
                ticks = [by[mode, lb].decode_speedup for lb in labels if (mode, lb) in by]
                ax.hlines(ticks, [x - width / 2 for x in xs], [x + width / 2 for x in xs],
                          color="black", lw=2, zorder=3,
                          label="decode speedup (after the first token)" if j == 0 else None)
        ax.axhline(1.0, color="black", lw=1, ls="--")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(name)
        ax.legend(fontsize=8, ncols=3, loc="upper center")
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, out: Path, console: Console, meta: dict, cells: list[tuple[str, SpecConfig]],
        load) -> int:
    """The `forerun bench structured` command: load, run, print, write."""
    tasks = sample_tasks(read_tasks(args.workload[0] if args.workload else WORKLOAD),
                         args.limit or None, args.seed)
    wants_draft = any(spec.method == "draft" for _, spec in cells)
    with Console(stderr=True).status(f"loading {args.target}"):
        engine = Engine(args.target, args.draft if wants_draft else None,
                        spec=SpecConfig("draft" if wants_draft else "none"), load=load)
    tasks = fitting(engine, tasks, args.max_tokens)
    meta = meta | {"loadavg_before": os.getloadavg()}  # other processes share the CPUs?
    total = len(tasks) * len(MODES) * (1 + len(cells)) * args.repeats
    with tqdm(total=total, desc="structured", unit="run", file=sys.stderr) as bar:
        def tick(r: Run):
            bar.set_postfix_str(f"{r.task_id} {r.mode} {r.label}", refresh=False)
            bar.update()

        runs = run_structured(engine, tasks, cells, args.max_tokens, args.repeats, args.seed,
                              tick)
    result = aggregate(runs)
    verdicts = comparison(result)
    title = (f"forerun bench structured: {Path(str(args.target)).name} ({meta['runtime']}, "
             f"{meta['dtype']}), {len(tasks)} JSON-extraction prompts, greedy, "
             f"{args.max_tokens} new tokens, medians of {args.repeats}")
    console.print(table(result, title))
    for label, v in verdicts.items():
        console.print(f"{label}: schema speedup {v['schema_speedup']:.2f}x / free "
                      f"{v['free_speedup']:.2f}x = {v['schema_over_free']:.2f} (decode only "
                      f"{v['schema_decode_speedup']:.2f}x / {v['free_decode_speedup']:.2f}x = "
                      f"{v['decode_schema_over_free']:.2f}); tokens per "
                      f"pass {v['accepted_per_pass']['schema']:.2f} vs "
                      f"{v['accepted_per_pass']['free']:.2f}: T1 (schema >= free) "
                      f"{'met' if v['t1_met'] else 'missed'}")
    (out / "structured.json").write_text(json.dumps(
        {"meta": meta | {"loadavg_after": os.getloadavg(), "tasks": len(tasks),
                         "max_tokens": args.max_tokens,
                         "repeats": args.repeats, "cells_run": [lb for lb, _ in cells]},
         "cells": [asdict(c) for c in result], "t1": verdicts,
         "runs": [asdict(r) for r in runs]}, indent=1))
    plot(out / "structured.png", result, title)
    console.print(f"wrote {out / 'structured.json'} and structured.png")
    print(json.dumps({"t1": {lb: {k: v[k] if not isinstance(v[k], float) else round(v[k], 3)
                                  for k in ("free_speedup", "schema_speedup",
                                            "schema_over_free", "t1_met",
                                            "decode_schema_over_free")}
                             for lb, v in verdicts.items()},
                      "valid": {f"{c.mode} {c.label}": round(c.valid, 3) for c in result},
                      "identical": {f"{c.mode} {c.label}": c.identical for c in result
                                    if c.identical is not None},
                      "results": str(out / "structured.json")}))
    return 0


def fitting(engine: Engine, tasks: list[Task], max_tokens: int) -> list[Task]:
    """Drop (with a note) tasks that leave no room for max_tokens in the context."""
    keep = []
    for t in tasks:
        n = len(prompt_ids(engine, t))
        if n + max_tokens <= engine.target.capacity:
            keep.append(t)
        else:
            print(f"skipping {t.id}: {n} prompt tokens + {max_tokens} > context "
                  f"{engine.target.capacity} (raise --context)", file=sys.stderr)
    if not keep:
        raise ValueError("no task fits the context; raise --context or lower --max-tokens")
    return keep
