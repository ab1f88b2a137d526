"""Options shared by several commands: models, speculation and sampling, and what they build.

Owns: the argparse groups (`add_model_args`, `add_spec_args`, `add_sampling_args`), the configs
they stand for (`load_config`, `spec_config`, `sampling_config`), `load_engine`, the stderr
console every command reports on, and the exit status of an expected error. Imports only the
library; no command module is imported here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from forerun.api import DEFAULT_MAX_TOKENS, Engine, LoadConfig
from forerun.cluster.drafter_actor import STRATEGIES
from forerun.grammar import Grammar
from forerun.heads import PRECISIONS
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET
from forerun.models.load import DEFAULT_CONTEXT, DTYPES, RUNTIMES
from forerun.models.requantize import QTYPES
from forerun.policy import POLICIES
from forerun.processors import Processing
from forerun.propose import PROPOSERS, SpecConfig, tree_budget
from forerun.propose.disaggregate import DEFAULT_WAIT_S, parse_cores
from forerun.propose.layer_skip import parse_layers
from forerun.propose.lookahead import DEFAULT_GUESSES, DEFAULT_NGRAM, DEFAULT_WINDOW
from forerun.propose.magicdec import DEFAULT_SINKS as MAGICDEC_SINKS
from forerun.propose.magicdec import DEFAULT_WINDOW as MAGICDEC_WINDOW
from forerun.propose.magicdec import DRAFTERS as MAGICDEC_DRAFTERS
from forerun.propose.multi import DEFAULT_METHODS, parse_methods
from forerun.propose.qspec import ACTIVATION_BITS as QSPEC_ACTIVATIONS
from forerun.propose.qspec import BITS as QSPEC_BITS
from forerun.propose.qspec import RUNTIMES as QSPEC_RUNTIMES
from forerun.propose.suffix import DEFAULT_CACHE_TOKENS, DEFAULT_FACTOR, DEFAULT_MIN_PROB
from forerun.sampling import SamplingConfig
from forerun.verify_spectr import TREE_VERIFIERS

EXIT_USAGE = 2  # an expected error (bad input): a one-line message, then this status
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
    g.add_argument("--invariant", action="store_true",
                   help="torch runtime: row-invariant kernels (a one-row matmul run as two, "
                        "attention padded to 4 query rows), so a token's logits do not depend "
                        "on how many rows share its pass; costs speed (see docs/runtimes.md)")


def load_config(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of the arguments add_model_args defined."""
    return LoadConfig(args.dtype, args.device, args.context, runtime=args.runtime,
                      draft_dtype=args.draft_dtype, draft_vocab=args.draft_vocab,
                      heads=args.heads, head_precision=args.head_precision,
                      invariant=args.invariant)


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The SpecConfig of the arguments add_spec_args defined."""
    return SpecConfig(args.method, args.k, args.policy, args.ngram_min, args.ngram_max,
                      args.tree, args.tree_topk, args.lookup, args.shadow,
                      suffix_cache_tokens=args.suffix_cache_tokens,
                      suffix_factor=args.suffix_factor, suffix_min_prob=args.suffix_min_prob,
                      suffix_cache_dir=args.suffix_cache_dir,
                      multi_methods=parse_methods(args.multi), multi_verifier=args.multi_verifier,
                      lookahead_window=args.lookahead_window, lookahead_ngram=args.lookahead_ngram,
                      lookahead_guesses=args.lookahead_guesses,
                      lookahead_auto=not args.lookahead_fixed,
                      skip_layers=args.skip_layers,
                      magicdec_sinks=args.magicdec_sinks, magicdec_window=args.magicdec_window,
                      magicdec_drafter=args.magicdec_drafter,
                      exit_layer=args.exit_layer, exit_adapter=args.exit_adapter,
                      qspec_runtime=args.qspec_runtime, qspec_bits=args.qspec_bits,
                      qspec_activations=args.qspec_activations, qspec_type=args.qspec_type,
                      disaggregate=args.disaggregate, draft_cores=args.draft_cores,
                      target_cores=args.target_cores, disaggregate_wait=args.disaggregate_wait,
                      disaggregate_lookup=args.disaggregate_lookup,
                      drafter_placement=(args.ray_strategy if args.ray and args.disaggregate
                                         else None))


def load_engine(args: argparse.Namespace, console: Console | None = None) -> Engine:
    """The Engine of the model and speculation arguments (the draft only when it drafts)."""
    spec = spec_config(args)
    needs_draft = spec.uses_draft
    join_ray_drafter(spec, args.ray_address)
    what = f"loading {args.target}" + (f" + {args.draft}" if needs_draft else "")
    with (console or err).status(what):
        return Engine(args.target, args.draft if needs_draft else None, spec=spec,
                      load=load_config(args))


def join_ray_drafter(spec: SpecConfig, address: str | None) -> None:
    """--disaggregate --ray: join the cluster at `address`, or start a local one with the
    drafter's and the target's cores (nothing without a drafter placement)."""
    if spec.drafter_placement is None:
        return
    from forerun.cluster.drafter_actor import join_cluster

    draft, target = spec.disaggregated().placement(os.sched_getaffinity(0))
    join_cluster(address, len(draft) + len(target))


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
    g.add_argument("--shadow", action="store_true",
                   help="shadow speculation: draft and verify with --method, count what would "
                        "have been accepted (the stats), but emit one token a pass, as plain "
                        "decoding: measures a method's acceptance on real traffic first")
    g.add_argument("--disaggregate", action="store_true",
                   help="--method draft: the draft model drafts ahead in a worker process on "
                        "cores of its own while the target verifies (an asynchronous pipeline; "
                        "lossless, but a seed no longer reproduces a sampled run); under serve and "
                        "generate --batch one worker drafts for every sequence of the batch, "
                        "one draft pass for all, and a pass takes what is ready (members with "
                        "nothing ready decode plainly in it)")
    g.add_argument("--draft-cores", type=cores_arg, default=None, metavar="CPUS",
                   help="--disaggregate: the drafter's CPU cores, as 1 or 2,3 or 2-3 "
                        "(default: the last one)")
    g.add_argument("--target-cores", type=cores_arg, default=None, metavar="CPUS",
                   help="--disaggregate: the target's (default: every other one)")
    g.add_argument("--disaggregate-wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                   help="--disaggregate: the most a target pass waits for a first draft "
                        "token before it runs plain (default: %(default)s)")
    g.add_argument("--disaggregate-lookup", type=int, default=0, metavar="N",
                   help="--disaggregate, greedy: each draft-model pass also checks up to N "
                        "tokens prompt lookup guesses, drafting those its argmax agrees with "
                        "(the same draft tokens, several a pass on copied text); 0 = off "
                        "(default: %(default)s)")
    # --ray (its drafter a Ray actor) where a command adds it: add_ray_args; serve has its own
    p.set_defaults(ray=False, ray_address=None, ray_strategy=STRATEGIES[0])
    g.add_argument("--ngram-min", type=int, default=1, help="shortest suffix to look up")
    g.add_argument("--ngram-max", type=int, default=4, help="longest suffix to look up")
    g.add_argument("--suffix-cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS, metavar="N",
                   help="--method suffix: the index of earlier requests' outputs that every "
                        "request of this engine or server drafts from, in tokens (28-40 bytes "
                        "each; oldest evicted first; 0 = none) (default: %(default)s)")
    g.add_argument("--suffix-factor", type=float, default=DEFAULT_FACTOR, metavar="A",
                   help="--method suffix: at most A x the match length draft nodes (and at "
                        "most -k) (default: %(default)s)")
    g.add_argument("--suffix-min-prob", type=float, default=DEFAULT_MIN_PROB, metavar="P",
                   help="--method suffix: no draft node whose estimated probability (its "
                        "continuation's frequency) is below P (default: %(default)s)")
    g.add_argument("--multi", default=",".join(DEFAULT_METHODS), metavar="METHODS",
                   help="--method multi: the methods whose drafts join one tree each step, "
                        "comma-separated; one listed k times drafts k times (default: "
                        "%(default)s)")
    g.add_argument("--multi-verifier", default="rrs", choices=list(TREE_VERIFIERS),
                   help="--method multi: rrs = merged into a trie, recursive rejection "
                        "sampling; spectr = SpecTr's k-sequential selection over k i.i.d. "
                        "drafts kept apart (--multi draft,draft,...) (default: %(default)s)")
    g.add_argument("--lookahead-window", type=int, default=DEFAULT_WINDOW, metavar="W",
                   help="--method lookahead: the most guessed future positions of its Jacobi "
                        "window (-k caps the rows a pass adds: give it 30 or more) "
                        "(default: %(default)s)")
    g.add_argument("--lookahead-ngram", type=int, default=DEFAULT_NGRAM, metavar="N",
                   help="--method lookahead: the n-gram size, collected from the window and "
                        "verified (N - 1 window levels) (default: %(default)s)")
    g.add_argument("--lookahead-guesses", type=int, default=DEFAULT_GUESSES, metavar="G",
                   help="--method lookahead: the most n-grams verified a pass "
                        "(default: %(default)s)")
    g.add_argument("--lookahead-fixed", action="store_true",
                   help="--method lookahead: always the whole window (as -k allows); by "
                        "default each pass takes the window with the most expected tokens/s "
                        "under the target's verify-cost curve, none where rows are dear")
    g.add_argument("--magicdec-sinks", type=int, default=MAGICDEC_SINKS, metavar="N",
                   help="--method magicdec: the first N tokens (attention sinks) every draft "
                        "query attends to (default: %(default)s)")
    g.add_argument("--magicdec-window", type=int, default=MAGICDEC_WINDOW, metavar="W",
                   help="--method magicdec: and the W most recent tokens; the drafter's KV "
                        "cache holds only these, so its cost does not grow with the context "
                        "(default: %(default)s)")
    g.add_argument("--exit-layer", type=int, default=None, metavar="E",
                   help="--method early-exit: the target's first E layers draft, writing the "
                        "target's own cache, and verification runs the layers above E only "
                        "for them (default: 8 of 28 layers, the same share of others)")
    g.add_argument("--exit-adapter", default=None, metavar="FILE|none",
                   help="--method early-exit: the exit adapter (safetensors from `forerun "
                        "train early-exit`), or none (the target's norm and LM head alone); "
                        "default: the one trained for the target and E, else none")
    g.add_argument("--magicdec-drafter", default="draft", choices=list(MAGICDEC_DRAFTERS),
                   help="--method magicdec: draft = the draft model (--draft), self = the "
                        "target's own weights, each over a sparse cache of its own "
                        "(default: %(default)s)")
    g.add_argument("--qspec-runtime", default="auto", choices=list(QSPEC_RUNTIMES),
                   help="--method qspec: where the target's low-precision copy drafts: torch "
                        "(its weights quantized, --qspec-bits), llama.cpp (the target's GGUF "
                        "on llama.cpp; under a llama.cpp target requantized, --qspec-type); "
                        "auto = llama.cpp for a GGUF target where it is installed, else torch "
                        "(default: %(default)s)")
    g.add_argument("--qspec-bits", type=int, default=8, choices=list(QSPEC_BITS),
                   help="--method qspec, torch draft: weight bits, int8 per row or int4 per "
                        "32 inputs (default: %(default)s)")
    g.add_argument("--qspec-activations", type=int, default=16, choices=list(QSPEC_ACTIVATIONS),
                   help="--method qspec, torch draft: activation bits, 16 = bfloat16, 8 = "
                        "quantized per call (W8A8, with --qspec-bits 8) (default: %(default)s)")
    g.add_argument("--qspec-type", default=None, choices=list(QTYPES),
                   help="--method qspec, llama.cpp draft: requantize the target's GGUF to this "
                        "type at first use, kept in the model cache with its SHA-256 (default: "
                        "the file as it is under a torch target, Q4_0 under a llama.cpp one)")
    g.add_argument("--skip-layers", type=parse_layers, default=None, metavar="LAYERS|FILE",
                   help="--method layer-skip: the target's layers its self-draft leaves out, "
                        "as 3,5,7-12 or a JSON file of `forerun tune layer-skip` (default: the "
                        "set tuned for the target, else every other layer of the middle half)")
    g.add_argument("--suffix-cache-dir", default=None, metavar="DIR",
                   help="--method suffix: keep the index of earlier outputs in DIR between runs "
                        "(loaded at its first use, written when the process exits)")


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """--ray for a command that runs one engine: its --disaggregate drafter as a Ray actor."""
    g = p.add_argument_group("the drafter on Ray (pip install 'forerun[cluster]'; "
                             "docs/cluster.md)")
    g.add_argument("--ray", action="store_true",
                   help="with --disaggregate: the drafter worker is a Ray actor, placed with "
                        "the target (this process) by a placement group of two bundles, "
                        "--draft-cores and --target-cores CPUs")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (auto, HOST:6379); unset = a local one on this "
                        "machine, stopped on exit")
    add_ray_strategy_arg(g)


def add_ray_strategy_arg(g) -> None:
    g.add_argument("--ray-strategy", default=STRATEGIES[0], choices=STRATEGIES,
                   help="--ray --disaggregate: the placement group's strategy: PACK keeps the "
                        "drafter's bundle beside the target's, SPREAD puts it on another node "
                        "where one has room (default: %(default)s)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the max")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide seen tokens' positive logits by R, multiply negative ones "
                        "(prompt and output; 1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="E",
                   help="subtract E from every generated token's logit (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="subtract F x its count from each generated token's logit (0 = off)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   type=_bias, help="add BIAS (-100..100) to token id TOKEN's logit (repeatable)")
    g.add_argument("--json-schema", default=None, metavar="PATH",
                   help="structured output: the text is JSON valid under this schema file")
    g.add_argument("--regex", default=None, help="structured output: the text matches this")
    g.add_argument("--grammar", default=None, metavar="PATH",
                   help="structured output: a Lark or GBNF grammar file the text follows")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="most new tokens (default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")



def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    """The SamplingConfig of the arguments add_sampling_args defined."""
    processing = Processing.of(args.repetition_penalty, args.presence_penalty,
                               args.frequency_penalty, dict(args.logit_bias))
    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p, args.seed,
                          processing, _grammar(args))


def _grammar(args: argparse.Namespace) -> Grammar | None:
    """The one structured-output option given (a clear error for two, or a missing file)."""
    given = [(k, v) for k, v in (("json_schema", args.json_schema), ("regex", args.regex),
                                 ("grammar", args.grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --regex, --grammar")
    if not given:
        return None
    kind, value = given[0]
    if kind != "regex":
        try:
            value = Path(value).read_text()
        except OSError as e:
            raise ValueError(f"--{kind.replace('_', '-')} {value}: {e.strerror}") from e
    return Grammar(kind, value)


def cores_arg(text: str) -> tuple[int, ...]:
    try:
        return parse_cores(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _bias(text: str) -> tuple[int, float]:
    """TOKEN=BIAS -> (token id, bias)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS (e.g. 151643=-100), got {text!r}"
                                         ) from None
