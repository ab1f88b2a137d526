"""Tokens per verify pass of multi-draft speculation on real weights: the draft model's chain
against several drafts merged into one tree (recursive rejection) and k i.i.d. draft chains
verified by SpecTr, at the same node budget (k chains of length L against one chain of k x L).

Usage: .venv/bin/python experiments/multi_acceptance.py [--temperature 1.0] [--max-tokens 64]
Prints a table (tokens a pass = accepted + 1, acceptance, tokens/s) and writes JSON next to
--out. Sampled decoding: each configuration runs the same prompts with the same seeds; the
figures are means over prompts and seeds. Public API only (forerun.Engine, SpecConfig).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from forerun import Engine, LoadConfig, SamplingConfig, SpecConfig

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain what a hash map is in three sentences.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "Refactor this code to use a list comprehension:\nresult = []\nfor x in range(10):\n"
    "    if x % 2 == 0:\n        result.append(x * x)\n",
]
# name -> SpecConfig: draft nodes per pass in the name (a merged tree may hold fewer)
CONFIGS = {
    "draft chain, 2 nodes": SpecConfig("draft", 2),
    "draft chain, 6 nodes": SpecConfig("draft", 6),
    "3 draft chains x 2, SpecTr (6 nodes)": SpecConfig(
        "multi", 2, multi_methods=("draft",) * 3, multi_verifier="spectr"),
    "3 draft chains x 2, merged, rrs (<= 6)": SpecConfig("multi", 2, multi_methods=("draft",) * 3),
    "draft + ngram x 3, merged, rrs (<= 6)": SpecConfig("multi", 3,
                                                         multi_methods=("draft", "ngram")),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--runtime", default="torch")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--target", default=None, help="default: the catalog's default pair")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--out", default="multi_acceptance.json")
    args = ap.parse_args()
    pair = {k: v for k, v in (("target", args.target), ("draft", args.draft)) if v}
    engine = Engine(**pair, spec=SpecConfig("draft"),
                    load=LoadConfig(args.dtype, runtime=args.runtime))
    rows = {}
    for name, spec in CONFIGS.items():
        passes, tokens, accepted, drafted, wall = [], 0, 0, 0, 0.0
        for prompt in PROMPTS:
            for seed in range(args.seeds):
                sampling = SamplingConfig(temperature=args.temperature, seed=seed)
                started = time.perf_counter()
                done = engine.generate(prompt, sampling=sampling, max_tokens=args.max_tokens,
                                       spec=spec)
                wall += time.perf_counter() - started
                passes.append(done.stats.mean_accepted_length)
                tokens += done.stats.new_tokens
                accepted, drafted = accepted + done.stats.accepted, drafted + done.stats.drafted
        rows[name] = {"tokens_per_pass": statistics.mean(passes),
                      "accepted_per_drafted_depth": accepted / max(1, drafted),
                      "tokens_per_s": tokens / wall}
        print(f"{name:42s} tokens/pass {rows[name]['tokens_per_pass']:.3f}  "
              f"tokens/s {rows[name]['tokens_per_s']:.2f}", flush=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
