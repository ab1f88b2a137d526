"""`forerun check`: is speculative decoding lossless for this target, method and drafter?

Owns: the check command's flags (which prompts, how many tokens, contexts and samples, the
false-failure rate), its tables and its exit status; the tests themselves are `forerun.check`.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from forerun.bench.report import describe_divergence
from forerun.bench.workloads import read_workload, sample_workloads
from forerun.check import FAIL, VERIFIERS, CheckReport, check, near_tie_margin
from forerun.commands.options import add_model_args, add_spec_args, err, load_engine
from forerun.models.load import resolve_dtype
from forerun.sampling import SamplingConfig

DEFAULT_WORKLOAD = "spec_bench:1"  # one Spec-Bench question per category: six prompts
EXIT_FAIL = 1  # the check failed (0: passed, or parted only at near-ties; 2: bad input)
TABLE_WIDTH = 140  # when stdout is not a terminal


def add_parser(sub) -> None:
    c = sub.add_parser(
        "check", help="check that speculative decoding is lossless here (greedy and sampled)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check losslessness for a target, a method and its drafter, in two tests.\n"
        "(a) Greedy identity: on each prompt, speculative greedy output against plain greedy\n"
        "    output; where one parts, plain's logit margin there tells a numerical near-tie\n"
        "    (below --near-tie) from a bug.\n"
        "(b) Sampling: at --contexts contexts (prompts plus plain tokens), the first token\n"
        "    of --samples draft + verify steps (the real proposer, the target's verify pass,\n"
        "    the engine's rejection sampler) against the target's own distribution there:\n"
        "    a chi-square test per context at --alpha / contexts (Bonferroni), so a lossless\n"
        "    engine fails with probability at most --alpha.\n"
        "Exit status: 0 pass (or greedy parted only at near-ties), 1 fail, 2 bad input.\n"
        "--verifier accept-all runs the same check with a broken verifier: it must fail, or\n"
        "the check cannot tell one apart on these models and prompts.")
    g = c.add_argument_group(f"prompts (default: {DEFAULT_WORKLOAD})")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                   help='prompts, one JSON object a line ({"prompt": ...}, Spec-Bench or '
                        "EditEval rows)")
    g.add_argument("--workload", action="append", default=[], metavar="NAME[:N]",
                   help="a shipped set (spec_bench, editeval) or JSONL file, N prompts per "
                        "category (default 1; 0 = all); repeatable")
    g.add_argument("--raw", action="store_true", help="prompts as they are, no chat template")
    t = c.add_argument_group("the tests")
    t.add_argument("--max-tokens", type=int, default=64,
                   help="(a) greedy tokens per prompt (default: %(default)s)")
    t.add_argument("--near-tie", type=float, default=None, metavar="MARGIN",
                   help="(a) plain's logit margin below which a divergence is a numerical "
                        "near-tie (default: by runtime and dtype: llama.cpp 0.6, bfloat16 "
                        "0.25, float32 1e-3, float64 1e-9)")
    t.add_argument("--contexts", type=int, default=4,
                   help="(b) contexts tested (default: %(default)s)")
    t.add_argument("--samples", type=int, default=2000,
                   help="(b) draft + verify steps per context (default: %(default)s)")
    t.add_argument("--alpha", type=float, default=1e-3,
                   help="(b) false-failure rate of the whole sampling test (default: "
                        "%(default)s)")
    t.add_argument("--temperature", type=float, default=1.0,
                   help="(b) sampling temperature, > 0 (default: %(default)s)")
    t.add_argument("--top-p", type=float, default=1.0, help="(b) nucleus mass (1 = off)")
    t.add_argument("--top-k", type=int, default=0, help="(b) keep the k likeliest (0 = off)")
    t.add_argument("--min-p", type=float, default=0.0, help="(b) drop below min-p x the max")
    t.add_argument("--seed", type=int, default=0, help="prompt sample and sampling seed")
    t.add_argument("--verifier", default="rejection", choices=list(VERIFIERS),
                   help="rejection: the engine's; accept-all: accepts every draft token, a "
                        "self-test of the check, which must then fail (default: %(default)s)")
    c.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    add_model_args(c)
    add_spec_args(c)
    c.set_defaults(func=run)


def run(args) -> int:
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p)
    if sampling.greedy:
        raise ValueError("--temperature must be > 0: the sampling test samples (greedy is (a))")
    if min(args.max_tokens, args.contexts, args.samples) < 1 or not 0 < args.alpha < 1:
        raise ValueError("--max-tokens, --contexts and --samples must be >= 1, --alpha in (0, 1)")
    near_tie = args.near_tie if args.near_tie is not None else near_tie_margin(
        args.runtime, resolve_dtype(args.dtype, args.device))
    engine = load_engine(args)
    prompts = _prompts(args, engine)
    with err.status(f"checking {args.method} on {len(prompts)} prompts"):
        report = check(engine, prompts, max_tokens=args.max_tokens, near_tie=near_tie,
                       contexts=args.contexts, samples=args.samples, sampling=sampling,
                       alpha=args.alpha, seed=args.seed, verifier=args.verifier)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        _print(report, engine.tokenizer.decode)
    return EXIT_FAIL if report.verdict == FAIL else 0


def _prompts(args, engine) -> list[tuple[str, list[int]]]:
    """(label, token ids) of every prompt asked for, those that fit the context."""
    texts = [(f"prompt {i + 1}", t) for i, t in enumerate(args.prompt)]
    rows = read_workload(args.prompts) if args.prompts else []
    if args.workload or not (texts or rows):
        rows += sample_workloads(args.workload or [DEFAULT_WORKLOAD], 1, args.seed)
    texts += [(f"{p.category}/{p.id}", p.text) for p in rows]
    out = []
    for label, text in texts:
        ids = engine.tokenizer.encode_prompt(text, raw=args.raw)
        if len(ids) + args.max_tokens <= engine.target.capacity:
            out.append((label, ids))
        else:
            err.print(f"skipping {escape(label)}: {len(ids)} prompt tokens + {args.max_tokens}"
                      f" > context {engine.target.capacity} (raise --context)")
    if not out:
        raise ValueError("no prompt fits the context; raise --context or lower --max-tokens")
    return out


def _print(report: CheckReport, decode) -> None:
    out = Console(width=None if sys.stdout.isatty() else TABLE_WIDTH, highlight=False)
    g, s = report.greedy, report.sampling
    out.print(f"forerun check: {report.method} k={report.k}, verifier {report.verifier}")
    table = Table(title=f"(a) greedy identity, {g.max_tokens} tokens", title_justify="left")
    for col in ("prompt", "tokens", "result"):
        table.add_column(col, justify="left" if col != "tokens" else "right")
    for r in g.prompts:
        result = ("identical" if r.identical else
                  ("near-tie: " if r.near_tie else "DIVERGES: ") + describe_divergence(
                      r.divergence, decode))
        table.add_row(escape(r.prompt), str(r.new_tokens), escape(result))
    out.print(table)
    out.print(f"(a) {g.verdict}: {sum(r.identical for r in g.prompts)} of {len(g.prompts)} "
              f"identical; a margin below {g.near_tie_margin:g} is a near-tie")
    if not s.contexts:
        out.print(f"(b) {s.verdict}: {s.note}")
    else:
        off = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # filters left off go unsaid
        at = ", ".join(f"{k} {v:g}" for k, v in s.sampling.items() if off.get(k) != v)
        table = Table(title=f"(b) sampling, {s.samples} samples a context, {at}",
                      title_justify="left")
        for col in ("context", "tokens", "chi2", "df", "p-value", "p=0 hits", "drafted",
                    "1st accepted", "verify passes", "result"):
            table.add_column(col, justify="left" if col in ("context", "result") else "right")
        for r in s.contexts:
            table.add_row(escape(r.prompt), str(r.context_tokens), f"{r.statistic:.1f}",
                          str(r.df), f"{r.p_value:.3g}", str(r.impossible), f"{r.drafted:.2f}",
                          f"{r.first_accepted:.2f}", str(r.verify_passes),
                          "pass" if r.passed else "FAIL")
        out.print(table)
        out.print(f"(b) {s.verdict}: every context's p-value must be >= {s.per_test_alpha:.3g} "
                  f"(alpha {s.alpha:g} / {len(s.contexts)} contexts), so a lossless engine "
                  f"fails (b) with probability <= {s.alpha:g}" + (f"; {s.note}" if s.note else ""))
    out.print(f"verdict: {report.verdict}")
