"""A head's drafts replayed over recorded greedy outputs: what its trees would accept, and how
the automatic budget compares with fixed chains and an oracle, under the target's verify curve.

Records, for each prompt, plain greedy decoding with the head drafting at every step anyway:
its full tree (depth 5, 2 children a node, the 18 nodes EAGLE-2's growth keeps with those
settings: tokens, parents, path log-probabilities) and the head's seconds, then replays each
output without the model. A step at output position i drafts the tree recorded there, cut by
a policy, accepts the longest path that matches the recorded output (greedy verification) plus
one token, and costs verify(nodes + 1) plus the head's time (`--level-ms` per tree level it
ran). Policies: `auto`, the automatic budget as `HeadProposer` runs it (the likeliest nodes,
`best_budget`, its calibration scale and its rests after empty drafts); `auto-norest`, without
the rests; `chainK`, the head's top-1 chain of K; `oracle`, the cut of the recorded tree with
the most tokens per second for the acceptance it will see. Speedups are decode time only
(plain: one pass a token). The head's features are those of plain decoding, which keep() makes
equal to a speculative run's (the llama.cpp runtime compacts its cache after a tree).
`--call-ms FIXED,ROW` also charges the automatic policies each head call's own cost, drafting
or not (a fixed part and EAGLE's catch-up per feature since the last call), priced in the
budget as `HeadProposer` prices it; `--rest MIN,MAX[,halve]` adds automatic policies with
other rest schedules, `--start S` one whose calibration scale starts at S. `--curve FILE`
replays under another verify curve (a `scripts/gpu_check.py --json` file's target curve):
the acceptance recorded here priced at a GPU's costs, a projection, not a run.

    python scripts/head_replay.py --heads DIR --runtime llama.cpp \\
        --workload spec_bench:3 --workload editeval:4 --record /tmp/heads.jsonl \\
        --call-ms 3.4,0.27 --rest 4,16 --rest 4,64,halve --start 0.8
    python scripts/head_replay.py --heads DIR --record /tmp/heads.jsonl \\
        --curve docs/gpu_check_h100_1128.json --level-ms 0.28 --call-ms 0.3,0
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

import forerun.propose.heads as head_module
from forerun.api import Engine, LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.profile import ForwardCurve, calibrated_curve
from forerun.propose import SpecConfig
from forerun.propose.base import Draft
from forerun.propose.heads import (
    CALIBRATION_MEMORY,
    CALIBRATION_PRIOR,
    CALIBRATION_START,
    CATCHUP_ROWS,
    MAX_IDLE,
    MIN_IDLE,
    PROMPT_WINDOW,
    REST_WINDOW,
    HeadProposer,
)
from forerun.sampling import SamplingConfig
from forerun.tree import best_budget, match_depth

DEPTH, TOPK = 5, 2
NODES = TOPK + (DEPTH - 1) * TOPK * TOPK  # everything grow_tree grows at beam = topk


def record(engine: Engine, prompts, max_tokens: int, path: Path) -> None:
    """Plain greedy decoding, the head's full tree recorded at every step (then discarded)."""
    grown: dict = {}
    grow_tree, propose = head_module.grow_tree, HeadProposer.propose

    def recording_grow(root, expand, **kw):
        def seen(frontier, found):
            grown["found"] = found
            return expand(frontier, found)
        return grow_tree(root, seen, **kw)

    def recording_propose(self, tokens, k, sampling, generator):
        started = time.perf_counter()
        grown.clear()
        draft = propose(self, tokens, DEPTH, sampling, generator)
        if "found" in grown:  # the head ran (not the first step after a featureless prefill)
            steps.append({"n": len(tokens), "tokens": draft.tokens.tolist(),
                          "parents": draft.parents.tolist(),
                          "scores": [c.score for c in grown["found"]],  # all kept: same order
                          "seconds": time.perf_counter() - started})
        return Draft(torch.zeros(0, dtype=torch.long))  # plain decoding goes on

    head_module.grow_tree, HeadProposer.propose = recording_grow, recording_propose
    try:
        with path.open("w") as f:
            for n, p in enumerate(prompts, 1):
                ids, steps = engine.encode(p.text), []
                out = engine.generate(ids, max_tokens=max_tokens,
                                      sampling=SamplingConfig(temperature=0)).token_ids
                f.write(json.dumps({"id": p.id, "category": p.category, "prompt": ids,
                                    "out": out, "steps": steps}) + "\n")
                f.flush()
                ms = statistics.median(s["seconds"] for s in steps) * 1000 if steps else 0
                print(f"[{n}/{len(prompts)}] {p.category} {p.id}: {len(ids)} + {len(out)} "
                      f"tokens, full tree {ms:.1f} ms", flush=True)
    finally:
        head_module.grow_tree, HeadProposer.propose = grow_tree, propose


def cut(step: dict, n: int) -> tuple[list[int], list[int], int]:
    """The n likeliest nodes of a recorded tree (with their ancestors): tokens, parents, and
    the levels the head ran to grow them."""
    scores, parents = step["scores"], step["parents"]
    keep = set(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n])
    for i in list(keep):
        while parents[i] >= 0:
            i = parents[i]
            keep.add(i)
    order = sorted(keep)
    index = {old: new for new, old in enumerate(order)}
    depth = {}
    for i in order:  # topological: a parent's depth is known first
        depth[i] = 1 + (depth[parents[i]] if parents[i] >= 0 else 0)
    return ([step["tokens"][i] for i in order],
            [index[parents[i]] if parents[i] >= 0 else -1 for i in order],
            max(depth.values(), default=1))


def top_chain(step: dict, k: int) -> list[int]:
    """The head's top-1 chain, k deep: the likeliest child at each level."""
    node, chain = -1, []
    for _ in range(k):
        kids = [i for i, p in enumerate(step["parents"]) if p == node]
        if not kids:
            break
        node = max(kids, key=lambda i: step["scores"][i])
        chain.append(step["tokens"][node])
    return chain


def replay(rec: dict, policy: str, verify, level: float, call: tuple[float, float] = (0, 0),
           rest: tuple[int, int, bool] = (MIN_IDLE, MAX_IDLE, False),
           start: float = CALIBRATION_START) -> tuple[float, int, int]:
    """Seconds for out[1:] after prefill, target passes, drafted nodes. `call`: a head call's
    fixed seconds and seconds a feature caught up (the features since its last call, at most
    REST_WINDOW after a rest, PROMPT_WINDOW at the first), paid by the automatic policies on
    every call, drafting or not (0, 0: levels only); `rest`: (MIN_IDLE, MAX_IDLE, whether a
    draft halves the next rest instead of resetting it); `start`: the calibration scale before
    any evidence."""
    prompt, out = rec["prompt"], rec["out"]
    at = {s["n"] - len(prompt): s for s in rec["steps"]}  # output position -> recorded tree
    i, seconds, passes, drafted = 1, 0.0, 0, 0
    min_idle, max_idle, halve = rest
    skip, idle, observed, predicted, fed = 0, min_idle, 0.0, 0.0, 1 - PROMPT_WINDOW
    while i < len(out):
        step, truth, n, accepted, cost = at.get(i), out[i:], 0, 0, 0.0
        if step is not None and policy == "oracle":
            best = 1.0 / verify(1)
            for m in range(1, len(step["scores"]) + 1):
                tokens, parents, depth = cut(step, m)
                got = match_depth(tokens, parents, truth)
                rate = (got + 1) / (verify(len(tokens) + 1) + level * depth)
                if rate > best:
                    best, n, accepted, cost = rate, len(tokens), got, level * depth
        elif step is not None and policy.startswith("chain"):
            chain = top_chain(step, int(policy[5:]))
            n, cost = len(chain), level * len(chain)
            accepted = match_depth(chain, list(range(-1, len(chain) - 1)), truth)
        elif step is not None and skip > 0:  # resting
            skip -= 1
        elif step is not None:  # auto, auto-norest
            scale = (observed + start * CALIBRATION_PRIOR) / (predicted + CALIBRATION_PRIOR)
            ranked = sorted(step["scores"], reverse=True)
            rows = min(i - fed, REST_WINDOW)  # features the call catches up over
            fed, overhead = i, call[0] + call[1] * min(rows, CATCHUP_ROWS) + level
            m, cost = best_budget(ranked, verify, scale, overhead=overhead), level
            if m:
                tokens, parents, depth = cut(step, m)
                n, accepted, cost = len(tokens), match_depth(tokens, parents, truth), level * depth
                expected = sum(math.exp(s) for s in ranked[:m])
                memory = math.exp(-expected / CALIBRATION_MEMORY)
                observed, predicted = memory * observed + accepted, memory * predicted + expected
                idle = max(min_idle, idle // 2) if halve else min_idle
            elif policy == "auto":
                skip, idle = idle, min(2 * idle, max_idle)
            cost += call[0] + call[1] * rows
        i += min(accepted + 1, len(out) - i)
        seconds += verify(n + 1) + cost
        passes, drafted = passes + 1, drafted + n
    return seconds, passes, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--heads", required=True, help="an EAGLE head folder (forerun train)")
    ap.add_argument("--runtime", default="llama.cpp")
    ap.add_argument("--workload", action="append", default=None,
                    help="NAME[:N] as in forerun bench (default: spec_bench:3, editeval:4)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--level-ms", type=float, default=3.0,
                    help="the head's milliseconds a tree level (w8a8 on this Zen 3: ~3)")
    ap.add_argument("--record", type=Path, default=Path("head_replay.jsonl"),
                    help="recorded trees: read if it exists, else generated and written here")
    ap.add_argument("--call-ms", default="0,0",
                    help="FIXED,ROW: a head call's fixed ms and ms a feature it catches up, on "
                         "every call of the automatic policies (EPYC, int8 h125: 3.4,0.27)")
    ap.add_argument("--rest", action="append", default=[],
                    help="MIN,MAX[,halve]: one more automatic policy with these rests between "
                         "probes (halve: a draft halves the next rest instead of resetting it)")
    ap.add_argument("--start", action="append", type=float, default=[],
                    help="one more automatic policy whose calibration scale starts here "
                         f"(default {CALIBRATION_START}) instead")
    ap.add_argument("--curve", type=Path,
                    help="replay under this verify curve instead of the target's here: a "
                         "scripts/gpu_check.py --json file (its target curve), e.g. to project "
                         "the recorded acceptance onto a GPU's costs (pair with its --level-ms "
                         "and --call-ms)")
    args = ap.parse_args()
    call = tuple(float(x) / 1000 for x in args.call_ms.split(","))
    rests = {"auto": (MIN_IDLE, MAX_IDLE, False)}
    for r in args.rest:
        lo, hi, *halve = r.split(",")
        rests[f"auto{lo}-{hi}{'h' if halve else ''}"] = (int(lo), int(hi), bool(halve))
    starts = {f"auto-s{x:g}": x for x in args.start}
    rests.update({name: rests["auto"] for name in starts})
    engine = None
    if not args.record.exists() or args.curve is None:
        engine = Engine(args.target, None,
                        spec=SpecConfig("eagle", DEPTH, tree=NODES, tree_topk=TOPK),
                        load=LoadConfig(runtime=args.runtime, heads=args.heads))
    if not args.record.exists():
        prompts = sample_workloads(args.workload or ["spec_bench:3", "editeval:4"], None,
                                   args.seed)
        record(engine, prompts, args.max_tokens, args.record)
    records = [json.loads(line) for line in args.record.read_text().splitlines()]
    if args.curve is not None:
        measured = json.loads(args.curve.read_text())["curves"]["target"]
        verify = ForwardCurve(tuple(measured["sizes"]), tuple(measured["seconds"]))
    else:
        verify = calibrated_curve(engine.target, NODES + 1)
    print("verify ms, 1/2/4/8/16 tokens:",
          " / ".join(f"{verify(n) * 1000:.1f}" for n in (1, 2, 4, 8, 16)))
    policies = (*rests, "auto-norest", "chain1", "chain2", "chain3", "oracle")
    print("decode speedup / tokens a pass")
    print(f"{'category':15s} " + " ".join(f"{p:>12s}" for p in policies))
    by_cat: dict[str, list[dict]] = {}
    for r in records:
        by_cat.setdefault(r["category"], []).append(r)
    spec_bench: dict[str, list[float]] = {p: [] for p in policies}
    for category, rs in by_cat.items():
        cells = []
        for p in policies:
            speedups, lengths = [], []
            for r in rs:
                seconds, passes, _ = replay(r, "auto" if p in rests else p, verify,
                                            args.level_ms / 1000, call,
                                            rests.get(p, rests["auto"]),
                                            starts.get(p, CALIBRATION_START))
                speedups.append((len(r["out"]) - 1) * verify(1) / seconds if seconds else 1.0)
                lengths.append((len(r["out"]) - 1) / passes if passes else 1.0)
            cells.append(f"{statistics.mean(speedups):5.2f}x/{statistics.mean(lengths):4.2f}")
            if category != "editeval":
                spec_bench[p].append(statistics.mean(speedups))
        print(f"{category:15s} " + " ".join(f"{c:>12s}" for c in cells))
    if any(spec_bench.values()):
        print(f"{'Spec-Bench mean':15s} " + " ".join(
            f"{statistics.mean(v):11.2f}x" for v in spec_bench.values()))


if __name__ == "__main__":
    main()
