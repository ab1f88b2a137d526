"""Where a served batch's time goes under the joint (adaptive) draft-length policy: a step trace.

`forerun bench serve` found `--spec-policy adaptive` far below `off` at C >= 4 on llama.cpp, with
multi-second inter-token stalls that in-process batches (every member admitted at once,
`batch_policy_breakdown.py`) do not show. This drives a `BatchSession` the way the server's
worker does, without HTTP: C closed-loop clients, each sending its next request as its last one
ends, prompts from the bench's chat set, 512-row passes. Every step is timed and broken down:
live members, prompt rows fed, draft tokens chosen, the shared draft call's seconds and the
rows it fed before drafting (catch-up), the target pass's rows and seconds. Prints one JSON
line per (mode, C): tok/s, the steps' totals, and the slowest steps with their breakdown.

    flock /tmp/forerun-bench.lock python experiments/serve_policy_trace.py --clients 4,16 \
        --modes off,adaptive --requests 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from forerun import Engine, LoadConfig, SpecConfig
from forerun.batch_policy import BatchCostPolicy
from forerun.batch_session import BatchSession
from forerun.bench.workloads import BUILTIN, sample_workloads
from forerun.propose.draft_batch import SharedDraftModel
from forerun.sampling import SamplingConfig


def trace(engine: Engine, prompts: list[list[int]], clients: int, requests: int,
          max_tokens: int, mode: str, k: int) -> dict:
    """One closed-loop run -> its figures."""
    spec = (SpecConfig("draft", k, policy="cost") if mode == "adaptive" else
            SpecConfig("draft", k) if mode == "fixed" else SpecConfig("none", 0))
    adaptive = mode == "adaptive"
    session = BatchSession(engine, 2 << 30, joint=adaptive, max_batch=32, max_batch_tokens=512)
    session.calibrate()
    step_log: dict = collections.Counter()
    choose, propose = BatchCostPolicy.choose, SharedDraftModel.propose

    def counted_choose(self, members, caps, paid=None, backlog=None, remaining=None):
        ks = choose(self, members, caps, paid, backlog, remaining)
        step_log["k"] += sum(ks)
        step_log["backlog_priced"] += sum(backlog or [])
        return ks

    def counted_propose(self, requests_):
        step_log["draft_fed"] += sum(len(r.tokens) - self.runtime.length(r.proposer.handle)
                                     for r in requests_ if r.k > 0)
        start = time.perf_counter()
        out = propose(self, requests_)
        step_log["draft_s"] += time.perf_counter() - start
        return out

    runtime_type = type(session.target)
    forward = runtime_type.forward

    def timed_forward(self, *a, **kw):
        start = time.perf_counter()
        out = forward(self, *a, **kw)
        if self is session.target:
            step_log["pass_s"] += time.perf_counter() - start
        return out

    BatchCostPolicy.choose, SharedDraftModel.propose = counted_choose, counted_propose
    runtime_type.forward = timed_forward
    sent = [0] * clients
    owner: dict[int, int] = {}
    tokens, steps = 0, []

    def send(c: int) -> None:
        seq = session.sequence(prompts[(c * requests + sent[c]) % len(prompts)],
                               SamplingConfig(), max_tokens, spec)
        owner[id(seq)] = c
        sent[c] += 1
        session.add(seq)

    try:
        for c in range(clients):
            send(c)
        start = time.perf_counter()
        while not session.idle:
            step_log.clear()
            live_before = len(session.live) + len(session.waiting)
            t0 = time.perf_counter()
            results = session.step()
            seconds = time.perf_counter() - t0
            emitted = sum(len(r.tokens) for _, r in results if r is not None)
            prefill = sum(1 for _, r in results if r is not None and r.prefill)
            tokens += emitted
            steps.append({"s": round(seconds, 3), "live": live_before, "emitted": emitted,
                          "prefills": prefill, **{k_: round(v, 3) for k_, v in step_log.items()}})
            for seq, r in results:
                if r is None or r.finish_reason is not None or seq.finish:
                    c = owner.pop(id(seq))
                    if seq in session.live:
                        session.drop(seq)
                    if sent[c] < requests:
                        send(c)
        wall = time.perf_counter() - start
    finally:
        BatchCostPolicy.choose, SharedDraftModel.propose = choose, propose
        runtime_type.forward = forward
        session.drop_all()
    total = collections.Counter()
    for s in steps:
        total.update({k_: v for k_, v in s.items() if isinstance(v, int | float)})
    slow = sorted(steps, key=lambda s: -s["s"])[:6]
    drafting = [s for s in steps if s.get("k")]
    return {"mode": mode, "clients": clients,
            "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 2), "steps": len(steps),
            "step_s_total": round(total["s"], 1), "draft_s_total": round(total["draft_s"], 1),
            "pass_s_total": round(total["pass_s"], 1),
            "other_s_total": round(total["s"] - total["draft_s"] - total["pass_s"], 1),
            "other_s_drafting_steps": round(sum(s["s"] - s.get("draft_s", 0) - s.get(
                "pass_s", 0) for s in drafting), 1),
            "emitted_drafting_steps": sum(s["emitted"] for s in drafting),
            "draft_fed_total": total["draft_fed"], "k_total": total["k"],
            "steps_drafting": sum(1 for s in steps if s.get("k")), "slowest": slow}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runtime", default="llama.cpp", choices=["llama.cpp", "torch"])
    p.add_argument("--clients", default="4,16")
    p.add_argument("--modes", default="off,adaptive", help="off, adaptive, fixed (k always)")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    args = p.parse_args()
    engine = Engine(args.target, args.draft,
                    load=LoadConfig(runtime=args.runtime))
    prompts = [engine.tokenizer.encode_chat(list(x.messages))
               for x in sample_workloads(list(BUILTIN), 5, 0)]
    for clients in map(int, args.clients.split(",")):
        for mode in args.modes.split(","):
            print(json.dumps(trace(engine, prompts, clients, args.requests, args.max_tokens,
                                   mode, args.k)), flush=True)


if __name__ == "__main__":
    main()
