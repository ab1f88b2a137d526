"""Head drafting cost against a target pass: median ms of one target forward(1) and of one
head `propose` (a chain of k, and a tree of --tree nodes), at a ~200-token context.

    python scripts/head_cost.py --heads ~/.cache/forerun/heads/qwen2.5-coder-1.5b-instruct/eagle \
        --method eagle --runtime llama.cpp
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from forerun.api import Engine, LoadConfig, head_precision
from forerun.propose import PROPOSERS, SpecConfig
from forerun.sampling import SamplingConfig, make_generator


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", required=True)
    ap.add_argument("--method", required=True)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--runtime", default="torch")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--tree", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--head-precision", default="auto")
    args = ap.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(args.dtype, runtime=args.runtime, heads=args.heads,
                                         head_precision=args.head_precision))
    text = Path(__file__).read_text()
    prompt = engine.tokenizer.encode(text, add_special=False)[:200]
    greedy = SamplingConfig(temperature=0)
    target = engine.target
    out = {"runtime": args.runtime, "method": args.method, "k": args.k, "tree": args.tree,
           "head_precision": head_precision(args.head_precision)}

    def one_pass():
        target.truncate(len(prompt))
        target.forward(torch.tensor(prompt[-1:]))

    target.truncate(0)
    target.forward(torch.tensor(prompt))
    out["target_fwd1_ms"] = median_ms(one_pass, args.repeat)
    for label, tree in (("chain", 0), ("tree", args.tree)):
        spec = SpecConfig(args.method, args.k, tree=tree)
        proposer = PROPOSERS[args.method](spec, target, None, engine.heads)
        proposer.prompt_features = True  # this script feeds the prompt's features itself
        tokens = list(prompt)
        target.truncate(0)
        base_hidden = target.forward(torch.tensor(tokens[:-1]), last_only=True,
                                     hidden_layers=proposer.hidden_layers).hidden  # [P-1, D]
        proposer.prefill(tokens[:-1])  # the cached prompt; tokens[-1] is the pending token
        proposer.feed(base_hidden)
        proposer.propose(tokens, args.k, greedy, make_generator(0))  # fills the eagle cache

        def draft(proposer=proposer, tokens=tokens, base_hidden=base_hidden):
            # a decode step's work: one new feature to take in, then the draft
            proposer.committed = len(tokens) - 2 - proposer.first  # the cache starts there
            proposer.feed({i: h[-1:] for i, h in base_hidden.items()})
            proposer.propose(tokens, args.k, greedy, make_generator(0))

        out[f"{label}_propose_ms"] = median_ms(draft, args.repeat)
        out[f"{label}_ratio"] = round(out[f"{label}_propose_ms"] / out["target_fwd1_ms"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
