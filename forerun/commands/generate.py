"""`forerun generate`: one prompt, its reply streamed on stdout, stats on stderr (or --json).

Owns: the generate command's flags and output, and `--compare` (plain decoding beside the
speculative run: speedup, identity, and where they part with the target's margin there).
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.markup import escape
from rich.table import Table

from forerun.api import Completion, Engine
from forerun.bench.report import NEAR_TIE, describe_divergence
from forerun.commands.options import (
    add_model_args,
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
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run)



def run(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt: pass it as an argument or on stdin")
    sampling = sampling_config(args)
    engine = load_engine(args)
    spec = engine.spec
    ids = engine.tokenizer.encode_prompt(prompt, raw=args.raw, system=args.system)
    kwargs = dict(sampling=sampling, max_tokens=args.max_tokens, stop=tuple(args.stop))
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
