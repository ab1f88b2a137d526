"""`forerun generate`: one prompt, its reply streamed on stdout, stats on stderr (or --json).

Owns: the generate command's flags and output, and `--compare` (plain decoding beside the
speculative run: speedup, identity, and where they part with the target's margin there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from forerun.api import DEFAULT_KV_BUDGET_BYTES, Completion, Engine
from forerun.bench.report import NEAR_TIE, describe_divergence
from forerun.commands.options import (
    add_model_args,
    add_ray_args,
    add_sampling_args,
    add_spec_args,
    err,
    load_engine,
    sampling_config,
)
from forerun.propose import SpecConfig
from forerun.reference import divergence

WARMUP_TOKENS = 2  # --compare warms both paths up before timing them


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt",
                         description="Generate a reply to PROMPT (or stdin), streamed as it comes.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding and report speedup and whether the outputs "
                          "are identical")
    gen.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's logprob (the target's raw log-softmax) and "
                     "its N likeliest alternatives (0-20)")
    gen.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                     help="with --json: the same for every prompt token (the first has none)")
    g = gen.add_argument_group("offline batches")
    g.add_argument("--batch", default=None, metavar="FILE.jsonl",
                   help="decode every line of FILE together instead of one PROMPT: "
                        '{"prompt": TEXT} (chat-templated unless --raw) or {"messages": [...]}, '
                        'optionally "max_tokens"; one target pass a step serves every live '
                        "line (torch runtime). Each output line is the input line plus text, "
                        "token_ids, finish_reason and stats, in input order")
    g.add_argument("--out", default=None, metavar="FILE.jsonl",
                   help="with --batch: write the output lines here instead of stdout")
    g.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="with --batch: at most N sequences per pass (default: as many as the KV "
                        "budget holds)")
    g.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET_BYTES / 2**30,
                   metavar="GIB", help="with --batch: KV-cache memory per model, GiB; a line "
                   "reserves its prompt + max tokens and waits while the budget is full")
    add_model_args(gen)
    add_spec_args(gen)
    add_ray_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run)



def run(args) -> int:
    if args.batch is not None:
        return _run_batch(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt: pass it as an argument or on stdin")
    sampling = sampling_config(args)
    engine = load_engine(args)
    spec = engine.spec
    ids = engine.tokenizer.encode_prompt(prompt, raw=args.raw, system=args.system)
    kwargs = dict(sampling=sampling, max_tokens=args.max_tokens, stop=tuple(args.stop),
                  logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    if args.compare:
        for s in (SpecConfig("none"), spec):  # first calls pay one-off costs: keep them untimed
            engine.generate(ids, **{**kwargs, "max_tokens": WARMUP_TOKENS}, spec=s)
    result = _run(engine, ids, kwargs, spec, stream=not args.json)
    if not args.compare:
        if args.json:
            print(json.dumps(result.to_dict()))
        else:
            _print_stats([result])
        return 0
    if not args.json:
        err.print(f"[dim]running plain decoding for comparison ({args.max_tokens} tokens max)")
    plain = _run(engine, ids, kwargs, SpecConfig("none"), stream=False)
    report = {"plain": plain.to_dict(), "speculative": result.to_dict(),
              "speedup": result.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9),
              "identical": plain.token_ids == result.token_ids}
    if sampling.greedy and not report["identical"]:  # where, and plain's margin there
        report["divergence"] = divergence(engine.target, ids, plain.token_ids, result.token_ids)
    if args.json:
        print(json.dumps(report))
    else:
        _print_stats([plain, result], speedup=report["speedup"], identical=report["identical"],
                     parted=report.get("divergence"), decode=engine.tokenizer.decode)
    return 0


def _run(engine: Engine, ids: list[int], kwargs: dict, spec: SpecConfig,
         stream: bool) -> Completion:
    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = engine.generate(ids, **kwargs, spec=spec, on_text=write if stream else None)
    if stream:
        sys.stdout.write("\n")
    return result


def _print_stats(results: list[Completion], speedup: float | None = None,
                 identical: bool | None = None, parted: dict | None = None,
                 decode=None) -> None:
    table = Table(title="forerun generate", title_justify="left")
    for col in ("method", "k", "tokens", "tok/s", "TTFT s", "ITL ms", "target passes",
                "accept rate", "mean acc. len", "finish"):
        table.add_column(col, justify="right")
    for r in results:
        s = r.stats
        spec_cols = ((f"{s.acceptance_rate:.2f}", f"{s.mean_accepted_length:.2f}")
                     if s.method != "none" else ("-", "-"))
        table.add_row(s.method, str(s.k), str(s.new_tokens), f"{s.tokens_per_s:.2f}",
                      f"{s.ttft_s:.2f}", f"{s.itl_s * 1000:.0f}", str(s.target_forward_passes),
                      *spec_cols, r.finish_reason)
    err.print(table)
    for r in results:
        if r.stats.per_position_acceptance:
            err.print(f"{r.stats.method} acceptance by draft position: " + " ".join(
                f"{a:.2f}" for a in r.stats.per_position_acceptance))
    if speedup is not None:
        verdict = "[green]identical[/]" if identical else "[yellow]differ[/] (see README: numerics)"
        err.print(f"speedup {speedup:.2f}x; speculative tokens vs plain: {verdict}")
    if parted:
        err.print(escape(f"they part at {describe_divergence(parted, decode)} ({NEAR_TIE})"))


def _read_batch(path: str) -> list[dict]:
    """The --batch file's lines, each checked: a JSON object with "prompt" or "messages"."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--batch {path}: {e.strerror}") from e
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--batch {path}, line {n}: not JSON ({e.msg})") from e
        ok = isinstance(row, dict) and (isinstance(row.get("prompt"), str) or (
            isinstance(row.get("messages"), list) and row["messages"]
            and all(isinstance(m, dict) for m in row["messages"])))
        if not ok:
            raise ValueError(f'--batch {path}, line {n}: expected {{"prompt": TEXT}} or '
                             '{"messages": [{"role": ..., "content": ...}, ...]}')
        budget = row.get("max_tokens")
        if budget is not None and not (isinstance(budget, int) and budget >= 1):
            raise ValueError(f"--batch {path}, line {n}: max_tokens must be an integer >= 1")
        rows.append(row)
    if not rows:
        raise ValueError(f"--batch {path}: no prompts")
    return rows


def _run_batch(args) -> int:
    rows = _read_batch(args.batch)  # a bad file fails before any model loads
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.kv_budget <= 0:
        raise ValueError(f"--kv-budget must be > 0 GiB, got {args.kv_budget}")
    engine = load_engine(args)
    prompts = [r["messages"] if "messages" in r else
               engine.tokenizer.encode_prompt(r["prompt"], raw=args.raw, system=args.system)
               for r in rows]
    with err.status(f"decoding {len(rows)} prompts together"):
        results = engine.generate_batch(
            prompts, sampling=sampling_config(args), stop=tuple(args.stop),
            max_tokens=[r.get("max_tokens", args.max_tokens) for r in rows],
            max_batch=args.max_batch, kv_budget_bytes=int(args.kv_budget * 2**30))
    lines = [json.dumps(row | {"text": c.text, "token_ids": c.token_ids,
                               "finish_reason": c.finish_reason, "stats": c.stats.to_dict()})
             for row, c in zip(rows, results, strict=True)]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    else:
        print("\n".join(lines))
    tokens = sum(c.stats.new_tokens for c in results)
    wall = max((c.stats.wall_s for c in results), default=0.0)
    err.print(f"{len(rows)} prompts, {tokens} new tokens in {wall:.2f} s: "
              f"{tokens / max(wall, 1e-9):.1f} tok/s in all" + (f"; wrote {args.out}" if args.out
                                                             else ""), highlight=False)
    return 0
