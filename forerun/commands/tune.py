"""`forerun tune layer-skip`: search the layers the target's self-draft leaves out, and keep them.

Owns: the command's flags, its progress bar, table and JSON report, and saving the set beside
the model cache (where `--method layer-skip` finds it). The search is
`forerun.tune.layer_skip`; where the set is kept, `forerun.propose.layer_skip`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from forerun.api import Engine
from forerun.commands.options import add_model_args, err, load_config
from forerun.models.catalog import ModelError
from forerun.profile import calibrated_curve
from forerun.propose import SpecConfig
from forerun.propose.layer_skip import format_layers, save_tuned
from forerun.runtime.torch_model import TorchRuntime
from forerun.train import CHAT_PROMPTS
from forerun.tune.layer_skip import (
    Calibration,
    SearchResult,
    Trial,
    TuneConfig,
    calibration_texts,
    search,
)


def add_parser(sub) -> None:
    t = sub.add_parser("tune", help="tune a drafting method to the target (layer-skip: which "
                       "layers its self-draft leaves out)")
    kinds = t.add_subparsers(dest="kind", required=True)
    s = kinds.add_parser(
        "layer-skip", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="search the layers the target's self-draft skips (--method layer-skip)",
        description="Search the set of layers the target leaves out when it drafts for "
        "itself (--method layer-skip), maximising the expected speedup: the skipped model's "
        "top-1 agreement with the target on the target's own greedy replies to calibration "
        "prompts (teacher-forced, one pass a candidate), against the weights it still reads, "
        "at the best draft length. Greedy elimination: each layer alone, then one more layer "
        "a round from the --pool that hurt least alone. The set is saved beside the model "
        "cache, where --method layer-skip finds it.")
    d = TuneConfig()
    s.add_argument("--prompts", type=int, default=d.prompts,
                   help=f"calibration prompts (of the training package's {len(CHAT_PROMPTS)})")
    s.add_argument("--reply-tokens", type=int, default=d.reply_tokens,
                   help="the target's greedy reply to each prompt, in tokens")
    s.add_argument("--max-k", type=int, default=d.max_k, help="longest draft priced")
    s.add_argument("--pool", type=int, default=d.pool, help="layers tried a round")
    s.add_argument("--max-evals", type=int, default=d.max_evals,
                   help="most candidate sets measured (the lone layers' included)")
    s.add_argument("--patience", type=int, default=d.patience,
                   help="rounds without a better speedup before it stops")
    s.add_argument("--max-seconds", type=float, default=d.max_seconds,
                   help="start no search round after this long (0 = no limit)")
    s.add_argument("--flat-verify", action="store_true",
                   help="price a verify pass of k+1 tokens as one of 1 token (the standard "
                        "formula) instead of by the target's measured verify curve")
    s.add_argument("--out", default=None, metavar="FILE.json",
                   help="write the set here too (use it with --skip-layers FILE.json)")
    s.add_argument("--no-save", action="store_true", help="do not keep it beside the model")
    s.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    add_model_args(s)
    s.set_defaults(func=run)


def run(args) -> int:
    cfg = TuneConfig(args.prompts, args.reply_tokens, args.max_k, args.pool, args.max_evals,
                     args.patience, args.max_seconds)
    if not cfg.prompts <= len(CHAT_PROMPTS):
        raise ValueError(f"--prompts must be 1..{len(CHAT_PROMPTS)}")
    load = load_config(args)
    if load.runtime != "torch":
        raise ModelError("layer-skip drafts with the target's own torch modules; use "
                         "--runtime torch (llama.cpp cannot run a model without some layers)")
    with err.status(f"loading {args.target}"):
        engine = Engine(args.target, None, spec=SpecConfig("none"), load=replace(load, heads=None))
    target, started = engine.target, time.perf_counter()
    if not isinstance(target, TorchRuntime):  # the torch loader's runtime
        raise ModelError(f"{args.target}: not a torch runtime")
    with err.status(f"the target's replies to {cfg.prompts} prompts"):
        prompts = [engine.encode(p) for p in CHAT_PROMPTS[:cfg.prompts]]
        texts = calibration_texts(target, prompts, cfg.reply_tokens, engine.tokenizer.stop_ids)
    verify = flat if args.flat_verify else _verify_ratio(target, cfg.max_k)
    calib = Calibration.of(texts)
    result = _search(target, calib, cfg, verify, quiet=args.json)
    record = {"skip": list(result.best.skip), "n_layers": target.config.n_layers,
              "target": args.target, "dtype": load.dtype, **asdict(result.best),
              "search": result.to_dict(), "seconds": round(time.perf_counter() - started, 1),
              "tuned": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if not args.no_save and target.source is not None:
        record["saved"] = str(save_tuned(target.source, record))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.json:
        print(json.dumps(record))
    else:
        _report(result, record)
    return 0


def flat(n: int) -> float:
    """The standard formula's verify pass: as dear at n tokens as at one."""
    return 1.0


def _verify_ratio(target: TorchRuntime, max_k: int) -> Callable[[int], float]:
    """A target pass over n tokens relative to one, from its measured verify curve."""
    with err.status("measuring the target's verify curve"):
        curve = calibrated_curve(target, max_k + 1)
    return lambda n: curve(n) / curve(1)


def _search(target: TorchRuntime, calib: Calibration, cfg: TuneConfig, verify,
            quiet: bool) -> SearchResult:
    """The search under a progress bar (on stderr; none under --json)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err, disable=quiet) as bar:
        task = bar.add_task("candidate sets", total=max(cfg.max_evals, target.config.n_layers))

        def seen(trial: Trial) -> None:
            bar.update(task, advance=1, description=f"skip {format_layers(trial.skip):<24} "
                       f"a={trial.agreement:.3f} x{trial.speedup:.2f}")

        return search(target, calib, cfg, verify, seen)


def _report(result: SearchResult, record: dict) -> None:
    out = Console()
    table = Table(title=f"layer-skip search: {result.evals} sets measured on {result.rows} "
                  f"rows ({result.stopped})")
    for name in ("round", "skip", "layers", "agreement", "cost", "k", "expected speedup"):
        table.add_column(name, justify="left" if name == "skip" else "right")
    for i, t in enumerate(result.rounds, 1):
        mark = " *" if t == result.best else ""
        table.add_row(str(i), format_layers(t.skip) + mark, str(len(t.skip)),
                      f"{t.agreement:.3f}", f"{t.cost:.3f}", str(t.k), f"{t.speedup:.2f}x")
    out.print(table)
    best = result.best
    out.print(f"best: skip {format_layers(best.skip) or 'none'} ({len(best.skip)} of "
              f"{record['n_layers']} layers): agreement {best.agreement:.3f}, draft cost "
              f"{best.cost:.3f} of a target pass, k = {best.k}, expected {best.speedup:.2f}x")
    if "saved" in record:
        out.print(f"saved {record['saved']} (--method layer-skip reads it)")
