"""The `forerun bench` command: arguments, progress bar, and where the results go.

Owns: turning flags into a BenchConfig, loading the engine and the peers once, the progress bar
(stderr, with ETA), the table (stdout), `results.json` and the PNG in --out, and the last stdout
line: one JSON summary for scripts. `forerun bench curve` measures the runtime's forward-time
curve instead (the cost model every speedup depends on); `structured` and `processors` hand
over to `forerun.bench.structured` and `forerun.bench.processor_cost`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from tqdm import tqdm

from forerun.api import DEFAULT_KV_BUDGET_BYTES, Engine, LoadConfig, head_precision, heads_device
from forerun.bench import processor_cost, report, serve_bench, structured, throughput
from forerun.bench.peers import PEER_NAMES, HFPeer, LlamaCppPeer, Peer
from forerun.bench.runner import INDEX_STATES, BenchConfig, encode, run_bench, runs_per_prompt
from forerun.bench.serve_bench import add_serve_args
from forerun.bench.workloads import BUILTIN, Prompt, sample_workloads
from forerun.commands.options import (
    add_model_args,
    add_ray_args,
    cores_arg,
    join_ray_drafter,
    load_config,
)
from forerun.models.load import open_model, resolve_dtype
from forerun.profile import cached_curve
from forerun.propose import SpecConfig, tree_budget

CURVE_SIZES = tuple(range(1, 33))
CURVE_CONTEXT = 200
DEFAULT_OUT = "out/bench"
TABLE_WIDTH = 160  # when stdout is not a terminal (files, CI logs)
STRUCTURED = ("structured", "processors")  # a schema's speedup, processors' cost
DEFAULT_WORKLOADS = ["spec_bench", "editeval"]  # `agentic` is asked for by name


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench", help="benchmark methods against plain decoding and peers on public prompts",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="methods (the default): run plain decoding and every method x k cell on "
        "each prompt, side by side in one process, and report speedups per category: a table "
        "on stdout, results.json and bench.png in --out, and one JSON summary as the last "
        "stdout line. curve: measure the forward time over 1..32 new tokens at a ~200-token "
        "context for the target (and draft), as a table, verify_curve.json and a plot. "
        "throughput: offline batches of --batches prompts decoded together (generate_batch) "
        "under each of --modes, the first of --methods and --ks drafting: total and "
        "per-sequence tok/s, peak KV memory, the chosen k; throughput.json/.md/.png. "
        "serve: start forerun serve once per --spec-policies (and/or take --base-url servers: "
        "vLLM, llama-server), drive 1..32 concurrent streaming chat clients over the prompts, "
        "and report total and per-request tok/s, TTFT and ITL p50/p99 and peak server RSS; "
        "serve_bench.json/.png. structured: the PyPI-metadata JSON-extraction prompts, each free "
        "and under its json_schema, through plain decoding and every --methods x --ks cell "
        "(default draft k=4, greedy): tok/s, speedup over plain of the same mode, acceptance, "
        "tokens per verify pass, valid-JSON share, identity with plain, and the schema/free "
        "speedup ratio; structured.json/.png. processors: plain decoding at batch "
        "1 on the same prompts, fast path vs the batch step, each without and with penalties + "
        "logit_bias, and under the schema: time per token over the fast path's; "
        "processors.json/.png.")
    b.add_argument("mode", nargs="?", choices=["methods", "curve", "throughput", "serve",
                                              *STRUCTURED],
                   default="methods", help="what to measure")
    b.add_argument("--workload", action="append", default=None,
                   help=f"{' or '.join(BUILTIN)} or a JSONL file, optionally NAME:N for N "
                        "prompts per category of it (repeatable; default: spec_bench and "
                        "editeval)")
    b.add_argument("--limit", type=int, default=5, help="prompts per category (0 = all)")
    b.add_argument("--seed", type=int, default=0, help="prompt sample, run order and sampling")
    b.add_argument("--methods", default=None,
                   help="comma-separated drafting methods (default: draft,ngram; structured: "
                        "draft)")
    b.add_argument("--ks", default="4", help="comma-separated draft lengths")
    b.add_argument("--temperatures", default="0", help="comma-separated; 0 = greedy")
    b.add_argument("--policies", default="fixed",
                   help="comma-separated draft length policies (fixed, adaptive, cost)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    b.add_argument("--tree", type=tree_budget, default=0, metavar="NODES|auto",
                   help="head methods (with --heads): draft trees of this many nodes, or auto "
                        "(sized per step from the verify-cost curve); 0 = chains")
    b.add_argument("--tree-topk", type=int, default=4, help="head methods: children per node")
    b.add_argument("--lookup", action="store_true",
                   help="head methods: add the prompt-lookup continuation as one more branch")
    b.add_argument("--disaggregate", action="store_true",
                   help="methods mode: the draft method as an asynchronous pipeline, its "
                        "draft model in a worker process on --draft-cores, the target (and so "
                        "plain decoding) on --target-cores")
    b.add_argument("--draft-cores", type=cores_arg, default=None, metavar="CPUS",
                   help="--disaggregate: the drafter's CPU cores (default: the last one)")
    b.add_argument("--target-cores", type=cores_arg, default=None, metavar="CPUS",
                   help="--disaggregate: the target's (default: every other one)")
    b.add_argument("--repeats", type=int, default=1,
                   help="run every prompt's round of methods this many times (each in its own "
                        "order) and keep each method's median-wall run: for noisy machines")
    b.add_argument("--suffix-index", default="warm", metavar="STATES",
                   help=f"method suffix: what its global index of earlier outputs holds as "
                        f"each run starts, a cell for each of the comma-separated "
                        f"{', '.join(INDEX_STATES)}: cold = nothing (the request's own prompt "
                        "and output only); warm = plain decoding's outputs of the prompts run "
                        "before it (a conversation's earlier turns, earlier conversations), "
                        "never its own")
    b.add_argument("--peers", nargs="?", const=",".join(PEER_NAMES), default="",
                   help=f"also run peers on the same prompts ({','.join(PEER_NAMES)}); "
                        "--peers alone = all")
    b.add_argument("--out", default=DEFAULT_OUT, help="folder for results.json and the plot")
    b.add_argument("--json", action="store_true", help="print only the JSON summary")
    t = b.add_argument_group("throughput")
    t.add_argument("--batches", default=",".join(map(str, throughput.BATCH_SIZES)),
                   help="comma-separated batch sizes (prompts decoded together)")
    t.add_argument("--modes", default=",".join(throughput.MODES),
                   help="comma-separated: off (plain batching), fixed (k each), cost (every "
                        "member's k chosen together from the cost of a pass of n rows)")
    t.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET_BYTES / 2**30,
                   metavar="GIB", help="KV-cache memory per model, GiB")
    t.add_argument("--throughput-peers", default="", metavar="NAMES",
                   help="comma-separated: vllm (offline LLM.generate; needs FORERUN_VLLM_PYTHON "
                        "and --vllm-model), llama-server (-np BATCH; needs FORERUN_LLAMA_SERVER), "
                        "each plain and with the draft model (k = the first of --ks); run in "
                        "their own environments (docs/results/peers-setup.md)")
    t.add_argument("--vllm-model", default=None, metavar="DIR",
                   help="the target as a Hugging Face folder for vLLM (made from the GGUF: "
                        "docs/results/peers-setup.md)")
    t.add_argument("--vllm-draft", default=None, metavar="DIR", help="the draft, likewise")
    add_serve_args(b)
    add_model_args(b)
    add_ray_args(b)
    b.set_defaults(func=run)


def _csv(text: str, kind=str) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stream = sys.stderr if args.json else sys.stdout
    console = Console(file=stream, width=None if stream.isatty() else TABLE_WIDTH)
    args.methods = args.methods or ("draft" if args.mode in STRUCTURED else "draft,ngram")
    cfg = BenchConfig(methods=_csv(args.methods), ks=_csv(args.ks, int),
                      temperatures=_csv(args.temperatures, float), policies=_csv(args.policies),
                      max_tokens=args.max_tokens, seed=args.seed, tree=args.tree,
                      tree_topk=args.tree_topk, lookup=args.lookup, repeats=args.repeats,
                      suffix_index=_csv(args.suffix_index), disaggregate=args.disaggregate)
    cfg.cells()  # validates method names and k before anything loads
    load = load_config(args)
    if args.mode == "structured":
        return structured.run(args, out, console, _meta(args, load), cfg.cells()[1:], load)
    if args.mode == "processors":
        return processor_cost.run(args, out, console, _meta(args, load), load)
    if args.mode == "serve":  # the servers load the models, each in its own process
        return serve_bench.run(args, out, _meta(args, load))
    curve = args.mode == "curve"
    wants_draft = curve or "draft" in cfg.methods[:1 if args.mode == "throughput" else None]
    disaggregate = args.disaggregate and wants_draft
    spec = SpecConfig("draft" if wants_draft else "none", disaggregate=disaggregate,
                      draft_cores=args.draft_cores, target_cores=args.target_cores,
                      drafter_placement=args.ray_strategy if args.ray and disaggregate else None)
    join_ray_drafter(spec, args.ray_address)
    with Console(stderr=True).status(f"loading {args.target}"):
        engine = Engine(args.target, args.draft if wants_draft else None, spec=spec, load=load)
    meta = _meta(args, load)
    if curve:
        return _verify_curve(engine, args, out, meta, console)
    if args.mode == "throughput":
        return _throughput(engine, args, out, meta, console)

    prompts = _fitting(engine, sample_workloads(args.workload or DEFAULT_WORKLOADS,
                                                args.limit or None, args.seed), cfg)
    peers = _peers(args, engine)
    total = len(prompts) * runs_per_prompt(cfg, peers)
    with tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
        def tick(run):
            bar.set_postfix_str(f"{run.category} {run.label}", refresh=False)
            bar.update()

        runs = run_bench(engine, prompts, cfg, peers, on_run=tick)
    cells = report.aggregate(runs)
    title = f"forerun bench: {Path(str(args.target)).name} ({meta['runtime']}, {meta['dtype']})"
    console.print(report.table(cells, title))
    ceilings = report.prefill_ceilings(runs)
    if ceilings:
        console.print(f"[dim]{escape(report.ceiling_line(ceilings))}[/dim]")
    notes = report.divergences(runs, engine.tokenizer.decode)
    if notes:
        console.print(f"[dim]{report.DIVERGENCE_HELP}:[/dim]")
        for note in notes:
            console.print(f"[dim]  {escape(note)}[/dim]")
    curve = cached_curve(engine.target)  # what --tree auto / --policy cost decided with
    if curve is not None:
        meta["calibrated_curve"] = curve.to_dict()
    report.write_json(out / "results.json", meta | {"config": asdict(cfg)}, cells, runs)
    (out / "results.md").write_text(report.markdown(cells, title, notes, ceilings))
    report.plot(out / "bench.png", cells, title)
    console.print(f"wrote {out / 'results.json'}, results.md and bench.png")
    print(json.dumps(report.summary(cells, ceilings) | {"results": str(out / "results.json")}))
    return 0


def _throughput(engine: Engine, args, out: Path, meta: dict, console: Console) -> int:
    batches, modes = _csv(args.batches, int), _csv(args.modes)
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches must be positive integers, got {args.batches!r}")
    for mode in modes:
        throughput.spec_of(mode, _csv(args.methods)[0], 1)  # a bad mode fails here
    method, k = _csv(args.methods)[0], _csv(args.ks, int)[0]
    cfg = BenchConfig(methods=(method,), ks=(k,), max_tokens=args.max_tokens)
    prompts = _fitting(engine, sample_workloads(args.workload or ["spec_bench"],
                                                args.limit or None, args.seed), cfg)
    messages = [list(p.messages) for p in prompts]
    budget = int(args.kv_budget * 2**30)
    with tqdm(total=len(batches) * len(modes), desc="throughput", unit="cell",
              file=sys.stderr) as bar:
        def tick(cell):
            bar.set_postfix_str(f"batch {cell.batch} {cell.mode}", refresh=False)
            bar.update()

        cells = throughput.run_throughput(engine, messages, modes, method, k, batches,
                                          args.max_tokens, budget, on_cell=tick)
    peers = _throughput_peers(args, k)
    engine.close()  # forerun's models leave memory before a peer loads its own
    if peers:
        plain = {c.batch: c.total_tok_s for c in cells if c.mode == "off"}
        cells += throughput.peer_cells(peers, [p.text for p in prompts], batches,
                                       args.max_tokens, plain)
    title = (f"forerun bench throughput: {Path(str(args.target)).name} ({meta['runtime']}, "
             f"{meta['dtype']}{', invariant' if meta['invariant'] else ''}), {method} k={k}, "
             f"{len(prompts)} prompts, "
             f"{args.max_tokens} new tokens")
    table = Table(title=title, title_justify="left")
    for col in throughput.COLUMNS:
        table.add_column(col, justify="right")
    for row in throughput.rows(cells):
        table.add_row(*row)
    console.print(table)
    (out / "throughput.json").write_text(json.dumps(
        {"meta": meta | {"method": method, "k": k, "prompts": len(prompts),
                         "max_tokens": args.max_tokens, "kv_budget_gib": args.kv_budget},
         "cells": [asdict(c) for c in cells]}, indent=1))
    (out / "throughput.md").write_text(throughput.markdown(cells, title))
    throughput.plot(out / "throughput.png", cells, title)
    console.print(f"wrote {out / 'throughput.json'}, throughput.md and throughput.png")
    print(json.dumps({"cells": [{"mode": c.mode, "batch": c.batch,
                                 "total_tok_s": round(c.total_tok_s, 2),
                                 "speedup": round(c.speedup, 3)} for c in cells],
                      "results": str(out / "throughput.json")}))
    return 0


def _throughput_peers(args, k: int) -> list:
    """The peers of --throughput-peers (`throughput_peers.BatchPeer`s; those not installed
    skipped, noted): each vLLM one loads once for every batch size, llama-server starts anew
    for each (its -np is the batch)."""
    from forerun.bench import throughput_peers as tp

    names = set(_csv(args.throughput_peers))
    unknown = names - {"vllm", "llama-server"}
    if unknown:
        raise ValueError(f"unknown throughput peer(s) {sorted(unknown)}; choose vllm, "
                         "llama-server")
    peers = []
    if "vllm" in names:
        python, note = tp.peer_path(tp.VLLM_VAR)
        if python is None or not args.vllm_model:
            print(f"vllm {note or 'skipped: no --vllm-model'}", file=sys.stderr)
        else:
            model, draft = Path(args.vllm_model), args.vllm_draft and Path(args.vllm_draft)
            peers.append(tp.VllmOffline(python, model))
            if draft:
                peers.append(tp.VllmOffline(python, model, draft, k))
    if "llama-server" in names:
        binary, note = tp.peer_path(tp.LLAMA_VAR)
        if binary is None:
            print(f"llama-server {note}", file=sys.stderr)
        else:
            target, draft = open_model(args.target).path, open_model(args.draft).path
            peers.append(tp.PerBatch(lambda b: tp.LlamaServerPeer(binary, target, parallel=b)))
            peers.append(tp.PerBatch(
                lambda b: tp.LlamaServerPeer(binary, target, draft, parallel=b, k=k)))
    return peers


def _fitting(engine: Engine, prompts: list[Prompt], cfg: BenchConfig) -> list[Prompt]:
    """Drop (with a note) prompts that leave no room for max_tokens in the context."""
    keep = []
    for p in prompts:
        n = len(encode(engine.tokenizer, p))
        if n + cfg.max_tokens <= engine.target.capacity:
            keep.append(p)
        else:
            print(f"skipping {p.category}/{p.id}: {n} prompt tokens + {cfg.max_tokens} > "
                  f"context {engine.target.capacity} (raise --context)", file=sys.stderr)
    if not keep:
        raise ValueError("no prompt fits the context; raise --context or lower --max-tokens")
    return keep


def _peers(args, engine: Engine) -> list[Peer]:
    names = _csv(args.peers)
    unknown = set(names) - set(PEER_NAMES)
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; choose from {PEER_NAMES}")
    peers: list[Peer] = []
    stop_ids = engine.tokenizer.stop_ids
    target = open_model(args.target).path
    with Console(stderr=True).status("loading peers"):
        if "hf" in names:
            draft = open_model(args.draft).path if "draft" in _csv(args.methods) else None
            peers.append(HFPeer(target, draft, resolve_dtype(args.dtype, args.device),
                                stop_ids))
        if "llama.cpp" in names:
            peers.append(LlamaCppPeer(target, engine.target.capacity, stop_ids))
    return peers


def _verify_curve(engine: Engine, args, out: Path, meta: dict, console: Console) -> int:
    from forerun.profile import measure_forward_curve

    models = {"target": engine.target} | ({"draft": engine.draft} if engine.draft else {})
    curves = {}
    for name, runtime in models.items():
        with Console(stderr=True).status(f"timing the {name}'s forward pass, 1..32 tokens"):
            curves[name] = measure_forward_curve(runtime, CURVE_SIZES, CURVE_CONTEXT).to_dict()
    table = Table(title=f"forward time at context {CURVE_CONTEXT} "
                        f"({meta['runtime']}, {meta['dtype']})", title_justify="left")
    table.add_column("new tokens", justify="right")
    for name in curves:
        table.add_column(f"{name} ms", justify="right")
        table.add_column(f"{name} / 1 token", justify="right")
    # what verifying n tokens can buy at best: all n accepted, drafting free
    table.add_column("ceiling", justify="right")
    table.add_column("acc. len for 2x", justify="right")
    t = curves["target"]["seconds"]
    ceilings = [n * t[0] / t[i] for i, n in enumerate(CURVE_SIZES)]
    for i, size in enumerate(CURVE_SIZES):
        row = [str(size)]
        for c in curves.values():
            row += [f"{c['seconds'][i] * 1e3:.1f}", f"{c['seconds'][i] / c['seconds'][0]:.2f}"]
        row += [f"{ceilings[i]:.2f}x", f"{2 * t[i] / t[0]:.1f}"]
        table.add_row(*row)
    console.print(table)
    best = max(range(len(CURVE_SIZES)), key=ceilings.__getitem__)
    console.print(f"[dim]ceiling: the speedup of verifying n tokens when all n are accepted and "
                  f"drafting is free, n·t(1)/t(n); acc. len for 2x: the mean accepted length a "
                  f"drafter needs at that n to double speed, 2·t(n)/t(1). Best ceiling "
                  f"{ceilings[best]:.2f}x at n = {CURVE_SIZES[best]}.[/dim]")
    (out / "verify_curve.json").write_text(json.dumps({"meta": meta, "curves": curves},
                                                      indent=1))
    report.plot_curves(out / "verify_curve.png", curves,
                       f"forward-time curve ({meta['runtime']}, {meta['dtype']})")
    print(json.dumps({"target_ms_1": round(t[0] * 1e3, 2),
                      "target_fwd5_over_fwd1": round(t[4] / t[0], 3),
                      "ceiling": round(ceilings[best], 3), "ceiling_tokens": CURVE_SIZES[best],
                      "results": str(out / "verify_curve.json")}))
    return 0


def _meta(args, load: LoadConfig) -> dict:
    runtime = load.runtime
    return {"target": args.target, "draft": args.draft, "runtime": runtime,
            "dtype": resolve_dtype(load.dtype, load.device) if runtime == "torch" else "gguf",
            "draft_dtype": resolve_dtype(load.draft_dtype, load.device),
            "draft_vocab": load.draft_vocab or "full", "device": load.device,
            "heads": load.heads, "invariant": load.invariant,
            "head_precision": head_precision(load.head_precision, heads_device(load)),
            "cpus": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
