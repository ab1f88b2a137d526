"""Where a batch's time goes under the joint (cost) draft-length policy, against no speculation.

For each batch size n and mode (`off`: method none; `cost`: the draft model under the batch
cost policy, as `forerun serve --spec-policy adaptive` runs it), `Engine.generate_batch` decodes
the bench's first n prompts together and this prints one JSON line: wall seconds and tok/s,
the target's passes, rows and seconds, the draft model's passes, rows and seconds (its
calibration passes included, in the first cost run of the process), the shared draft calls, the
rows they fed before drafting (a member's catch-up: its prompt on a first draft) and the tokens
drafted, and how often each total draft length was chosen. The runtime's forward and the
policy's choice are wrapped, not changed.

    flock /tmp/forerun-bench.lock python experiments/batch_policy_breakdown.py \
        --sizes 1,4,8 --modes off,cost --max-tokens 48
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from forerun import Engine, LoadConfig, SpecConfig
from forerun.batch_policy import BatchCostPolicy
from forerun.bench.workloads import BUILTIN, sample_workloads
from forerun.propose.draft_batch import SharedDraftModel


def wrapped(log: collections.Counter, chosen: collections.Counter, target, view_class):
    """Patch the policy's choice, the shared draft's call and the batched forward to count into
    `log` and `chosen` -> a function that undoes it."""
    choose, propose, forward = (BatchCostPolicy.choose, SharedDraftModel.propose,
                                view_class.forward)

    def counted_choose(self, members, caps, paid=None, backlog=None, remaining=None):
        ks = choose(self, members, caps, paid, backlog, remaining)
        chosen[sum(ks)] += 1
        return ks

    def counted_propose(self, requests):
        fed = sum(len(r.tokens) - self.runtime.length(r.proposer.handle)
                  for r in requests if r.k > 0)
        start = time.perf_counter()
        out = propose(self, requests)
        log["draft_call_s"] += time.perf_counter() - start
        log["draft_calls"] += 1
        log["draft_fed_rows"] += fed
        log["drafted"] += sum(r.k for r in requests)
        return out

    def counted_forward(self, batch, hidden_layers=()):
        start = time.perf_counter()
        out = forward(self, batch, hidden_layers)
        who = "target" if self.single is target else "draft"
        log[f"{who}_s"] += time.perf_counter() - start
        log[f"{who}_rows"] += len(batch.tokens)
        log[f"{who}_passes"] += 1
        return out

    BatchCostPolicy.choose, SharedDraftModel.propose = counted_choose, counted_propose
    view_class.forward = counted_forward

    def undo():
        BatchCostPolicy.choose, SharedDraftModel.propose = choose, propose
        view_class.forward = forward
    return undo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runtime", default="llama.cpp", choices=["llama.cpp", "torch"])
    p.add_argument("--sizes", default="1,4,8")
    p.add_argument("--modes", default="off,cost")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    engine = Engine("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                    load=LoadConfig(runtime=args.runtime))
    if args.runtime == "llama.cpp":
        from forerun.runtime.llama_batch import BatchLlamaRuntime as view_class
    else:
        from forerun.runtime.batch import BatchTorchRuntime as view_class
    prompts = [list(x.messages) for x in sample_workloads(list(BUILTIN), 5, 0)]
    for n in map(int, args.sizes.split(",")):
        for mode in args.modes.split(","):
            log, chosen = collections.Counter(), collections.Counter()
            undo = wrapped(log, chosen, engine.target, view_class)
            spec = (SpecConfig("none", 0) if mode == "off"
                    else SpecConfig("draft", args.k, policy="cost"))
            start = time.perf_counter()
            try:
                outs = engine.generate_batch(prompts[:n], max_tokens=args.max_tokens, spec=spec,
                                             max_batch=n)
            finally:
                undo()
            wall = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            print(json.dumps({"mode": mode, "n": n, "wall_s": round(wall, 1),
                              "tok_s": round(tokens / wall, 2),
                              **{k: round(v, 2) for k, v in log.items()},
                              "total_k_chosen": dict(sorted(chosen.items()))}), flush=True)


if __name__ == "__main__":
    main()
