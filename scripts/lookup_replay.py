"""Prompt-lookup drafting replayed over recorded greedy outputs: how close its pricing comes to
an oracle that knows each continuation's accepted length, under the target's verify curve.

Records plain greedy outputs once (prompt and output ids, JSONL), measures the target's verify
curve (`forerun.profile.calibrated_curve`, as the automatic budget does), then replays each
output without the model: every step drafts the lookup continuation cut by a policy, accepts
its prefix that matches the recorded output (greedy verification) plus one token, and costs
verify(drafted + 1). Policies: `branch`, the heads' lookup branch as drafted while the head
rests (`LookupBranch` + `best_budget`); `ngram-cost`, `--method ngram --policy cost`
(`NgramProposer` + `CostModelK`); `oracle`, the drafted length that is fastest for the
accepted length it will see. Speedups are decode time only (plain: one pass a token).

    python scripts/lookup_replay.py --runtime llama.cpp --workload editeval:30 \
        --workload spec_bench:3 --record /tmp/lookup.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from forerun.api import Engine, LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.policy import CostModelK
from forerun.profile import calibrated_curve
from forerun.propose import SpecConfig
from forerun.propose.ngram import LookupBranch, find_match
from forerun.tree import best_budget


def matched(chain: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(chain), len(truth)) and chain[n] == truth[n]:
        n += 1
    return n


def replay(prompt: list[int], out: list[int], k: int, verify, policy: str,
           min_n: int, max_n: int) -> tuple[float, int, int]:
    """Seconds to produce out[1:] after prefill (out[0] came with it), draft rows, wasted rows."""
    tokens, i, seconds, rows, wasted = [*prompt, out[0]], 1, 0.0, 0, 0
    branch = LookupBranch(min_n, max_n)
    cost = CostModelK(k, verify)
    while i < len(out):
        if policy == "branch":
            chain, scores = branch.propose(tokens, k)
            m = best_budget(scores, verify)
        else:
            want = cost.next_k() if policy == "ngram-cost" else k
            chain = find_match(np.asarray(tokens, dtype=np.int64), want, min_n, max_n)[0].tolist()
            m = len(chain)
        hit = matched(chain, out[i:i + len(chain)])
        if policy == "oracle":  # the cut with the most tokens per second for this step
            m = max(range(hit + 1), key=lambda n: (n + 1) / verify(n + 1))
        elif policy == "ngram-cost":
            cost.update(m, min(hit, m))
        accepted = min(hit, m)
        step = min(accepted + 1, len(out) - i)
        tokens.extend(out[i:i + step])
        i += step
        seconds += verify(m + 1)
        rows, wasted = rows + m, wasted + m - accepted
    return seconds, rows, wasted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--runtime", default="llama.cpp")
    ap.add_argument("--workload", action="append", default=None,
                    help="NAME[:N] as in forerun bench (default: editeval:30, spec_bench:3)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=16, help="lookup continuation length (the cap)")
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", default="4", help="longest suffix tried; a comma list "
                    "compares several under one measured curve")
    ap.add_argument("--record", type=Path, default=Path("lookup_replay.jsonl"),
                    help="plain outputs: read if it exists, else generated and written here")
    args = ap.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig(method="none"),
                    load=LoadConfig(runtime=args.runtime))
    if not args.record.exists():
        prompts = sample_workloads(args.workload or ["editeval:30", "spec_bench:3"], None,
                                   args.seed)
        with args.record.open("w") as f:
            for n, p in enumerate(prompts, 1):
                ids = engine.encode(p.text)
                out = engine.generate(ids, max_tokens=args.max_tokens).token_ids
                f.write(json.dumps({"id": p.id, "category": p.category, "prompt": ids,
                                    "out": out}) + "\n")
                print(f"[{n}/{len(prompts)}] {p.category} {p.id}: {len(ids)} + {len(out)} tokens",
                      flush=True)
    records = [json.loads(line) for line in args.record.read_text().splitlines()]
    verify = calibrated_curve(engine.target, args.k + 1)
    print("verify ms, 1/2/4/8/16 tokens:",
          " / ".join(f"{verify(n) * 1000:.1f}" for n in (1, 2, 4, 8, 16)))
    by_cat: dict[str, list[dict]] = {}
    for r in records:
        by_cat.setdefault(r["category"], []).append(r)
    for max_n in (int(n) for n in args.ngram_max.split(",")):
        print(f"\nsuffixes {args.ngram_min}..{max_n}: mean decode speedup (wasted / drafted rows)")
        print(f"{'category':15s} {'prompts':>7s} {'tokens':>6s}  "
              + "  ".join(f"{p:>22s}" for p in ("branch", "ngram-cost", "oracle")))
        for category, rs in by_cat.items():
            cells = []
            for policy in ("branch", "ngram-cost", "oracle"):
                speedups, rows, wasted = [], 0, 0
                for r in rs:
                    s, n, w = replay(r["prompt"], r["out"], args.k, verify, policy,
                                     args.ngram_min, max_n)
                    speedups.append((len(r["out"]) - 1) * verify(1) / s if s else 1.0)
                    rows, wasted = rows + n, wasted + w
                cells.append(f"{statistics.mean(speedups):5.2f}x ({wasted}/{rows})")
            tokens = sum(len(r["out"]) for r in rs)
            print(f"{category:15s} {len(rs):7d} {tokens:6d}  "
                  + "  ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
