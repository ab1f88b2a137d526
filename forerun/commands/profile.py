"""`forerun profile {gpu,heads}`: where the time goes, on a device or in a head's drafts.

Owns: the two modes' flags and what they print and write. `gpu` checks the torch runtime's
device path on random-initialised models of the default pair's shapes (equality, verify curves,
decode speed, heads' drafting cost; `forerun.bench.gpu`); `heads` times trained heads' drafting
against a one-token target pass (`forerun.bench.heads_cost`). Both print one JSON line last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from forerun.api import Engine, head_precision, heads_device
from forerun.bench.gpu import GpuCheckConfig, gpu_check
from forerun.bench.heads_cost import heads_cost
from forerun.commands.options import EXIT_USAGE, add_model_args, err, load_config
from forerun.propose import SpecConfig, tree_budget

DEFAULT_PROMPT = ("Refactor this function to use a dataclass:\n\ndef make_user(name, email, age):"
                  "\n    return {\"name\": name, \"email\": email, \"age\": age}")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="check and time the GPU path, or a head's drafting cost",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="gpu: greedy equality, verify curves, decode speed and heads' drafting cost "
        "of the torch runtime on --device, on random models of the default pair's shapes (no "
        "weights needed); heads: trained heads' drafting cost against a one-token target pass "
        "(--heads DIR). --device defaults to cuda for gpu and cpu for heads, --dtype to "
        "bfloat16 for gpu's timings (its equality checks run in float32) and auto for heads.")
    p.add_argument("mode", choices=["gpu", "heads"])
    g = p.add_argument_group("gpu")
    g.add_argument("--small", action="store_true",
                   help="tiny shapes: a smoke test, fine on the CPU")
    g.add_argument("--precisions", default="bfloat16,int8",
                   help="head drafting precisions to time, comma-separated")
    h = p.add_argument_group("heads")
    h.add_argument("--tree", type=tree_budget, default=8, metavar="NODES|auto",
                   help="the tree timed besides the chain of -k")
    h.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt decoded greedily")
    p.add_argument("-k", type=int, default=4, help="draft length (tree depth)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens decoded per timing (gpu: the decode-speed runs)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    add_model_args(p)
    p.set_defaults(func=run, device=None, dtype=None)


def run(args) -> int:
    if args.mode == "gpu":
        cfg = GpuCheckConfig(args.device or "cuda", args.dtype or "bfloat16", args.max_tokens,
                             args.k, tuple(args.precisions.split(",")), args.small)
        results = gpu_check(cfg, report=print)
    else:
        if not args.heads:
            err.print("forerun profile heads needs --heads DIR (made by `forerun train`)")
            return EXIT_USAGE
        args.device, args.dtype = args.device or "cpu", args.dtype or "auto"
        load = load_config(args)
        with err.status(f"loading {args.target} and {args.heads}"):
            engine = Engine(args.target, None, spec=SpecConfig("none"), load=load)
        prompt = engine.tokenizer.encode_prompt(args.prompt)
        results = heads_cost(engine.target, engine.heads, engine.heads.cfg.kind, prompt, args.k,
                             args.tree, args.max_tokens)
        results |= {"runtime": load.runtime,
                    "head_precision": head_precision(load.head_precision, heads_device(load))}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))
    return 0
