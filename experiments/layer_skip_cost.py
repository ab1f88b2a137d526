"""What does a layer-skip draft step cost, measured, as a fraction of a target pass, and what
memory does the self-draft add? (`forerun tune layer-skip` prices a step by the weights it
reads; this times it.)

Loads the target (torch), builds its self-draft without the given layers (default: the set
tuned for the target), fills both caches with the same CONTEXT tokens and times one-token
passes of each, alternating, the median of REPS; prints and writes JSON: the two times, their
ratio, the weights-read estimate, and the draft's KV cache bytes at that context (its only
memory of its own: the weights are the target's).

    python experiments/layer_skip_cost.py --dtype bfloat16 --out out/layer_skip_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from forerun import Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.propose.layer_skip import LayerSkipConfig, format_layers, parse_layers
from forerun.tune.layer_skip import draft_cost

CONTEXT = 200  # cached tokens before the timed passes (as `forerun bench curve`)
REPS = 30


def one_token_seconds(runtime, base: int, token: int) -> float:
    runtime.truncate(base)
    start = time.perf_counter()
    runtime.forward(torch.tensor([token]), last_only=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-layers", type=parse_layers, default=None)
    p.add_argument("--out", default="out/layer_skip_cost.json")
    args = p.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(args.dtype, runtime="torch"))
    target = engine.target
    skip = LayerSkipConfig(args.skip_layers).resolve(target)
    draft = target.without_layers(skip, CONTEXT + 8)
    ids = torch.arange(1000, 1000 + CONTEXT)
    for rt in (target, draft):
        rt.truncate(0)
        rt.forward(ids, last_only=True)
    times = {"target": [], "draft": []}
    for i in range(REPS + 3):  # alternating, so drift hits both; the first 3 warm up
        for name, rt in (("target", target), ("draft", draft)):
            seconds = one_token_seconds(rt, CONTEXT, 2000 + i)
            if i >= 3:
                times[name].append(seconds)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    kv = 2 * draft.k_cache.element_size() * draft.config.n_layers * draft.config.n_kv_heads \
        * draft.config.head_dim  # bytes a cached token
    record = {"target": args.target, "dtype": args.dtype, "skip": list(skip),
              "skip_text": format_layers(skip), "n_layers": target.config.n_layers,
              "context": CONTEXT, "reps": REPS, "target_ms": round(1e3 * med["target"], 2),
              "draft_ms": round(1e3 * med["draft"], 2),
              "measured_cost": round(med["draft"] / med["target"], 3),
              "weights_cost": round(draft_cost(target, len(skip)), 3),
              "draft_kv_bytes_per_token": kv, "threads": torch.get_num_threads()}
    print(json.dumps(record))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
