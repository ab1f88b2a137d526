"""Held-out agreement of trained heads at each drafting precision (`forerun.heads.PRECISIONS`):
the top-1/top-5 agreement with the target `forerun train` reports, recomputed on the same
held-out windows after the heads' weights are cast (bfloat16) or quantized (int8) for drafting.

    H=~/.cache/forerun; python scripts/head_precision.py \
        --heads $H/heads/qwen2.5-coder-1.5b-instruct/eagle \
        --data $H/train-data/qwen2.5-coder-1.5b-instruct-auto-L-1-T256-C138x128

`--windows 0:138` keeps the chat replies' held-out windows only (the data folder's own
indices: written questions, then `--self-chat`'s, then code).
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from forerun.api import Engine, LoadConfig
from forerun.heads import PRECISIONS
from forerun.propose import SpecConfig
from forerun.train import TrainConfig, agreement, load_shards, vocab_lookup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", required=True)
    ap.add_argument("--data", required=True,
                    help="a collection: the heads' own, or another runtime's of the same corpus")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--windows", default=":", metavar="START:END",
                    help="only the held-out windows with these indices (a collection's chat "
                         "replies come first, then --self-chat's, then code)")
    args = ap.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(heads=args.heads, head_precision="float32"))
    heads = engine.heads
    cfg = TrainConfig(**heads.cfg.training["config"])
    shards = load_shards(sorted(Path(args.data).expanduser().glob("window-*.safetensors")))
    every = round(1 / cfg.held_out)  # the held-out windows `forerun.train.train` kept
    first, _, last = args.windows.partition(":")
    span = range(int(first or 0), int(last or len(shards)))
    held = [w for i, w in enumerate(shards) if i % every == every - 1 and i in span]
    lookup = vocab_lookup(heads)
    out = {"kind": heads.cfg.kind, "held_out_windows": len(held)}
    for precision in args.precisions:
        drafting = copy.deepcopy(heads).for_drafting(precision)
        out[precision] = agreement(drafting, held, cfg, lookup)
        print(precision, json.dumps(out[precision]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
