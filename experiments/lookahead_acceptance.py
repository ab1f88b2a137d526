"""How many tokens does a verify pass yield with lookahead decoding's whole window, against
prompt lookup, per workload category? (Where rows are nearly free, a GPU, tokens per pass is
the speedup's ceiling; on a CPU the sizing turns the window down, so the bench's wall-clock
ratios hide it.)

Each prompt (greedy, the chat template) runs plain, `lookahead` with its whole window
(`--lookahead-fixed`: W x (N - 1) lookahead rows + G guesses a pass) and `ngram` k=16 fixed;
it prints tokens per pass and whether each output is plain's, per category and
overall, and writes JSON.

    python experiments/lookahead_acceptance.py --runtime llama.cpp --workload spec_bench:2 \
        --workload editeval:4 --max-tokens 64 --out out/lookahead_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from forerun import Engine, LoadConfig
from forerun.bench.workloads import sample_workloads
from forerun.propose import SpecConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--runtime", default="llama.cpp")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workload", action="append", default=None)
    p.add_argument("--limit", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=7)
    p.add_argument("--ngram", type=int, default=4)
    p.add_argument("--guesses", type=int, default=7)
    p.add_argument("--out", default="out/lookahead_acceptance.json")
    args = p.parse_args()
    engine = Engine(args.target, None, spec=SpecConfig("none"),
                    load=LoadConfig(args.dtype, runtime=args.runtime))
    specs = {
        "lookahead": SpecConfig("lookahead", 64, lookahead_window=args.window,
                                lookahead_ngram=args.ngram, lookahead_guesses=args.guesses,
                                lookahead_auto=False),
        "ngram k=16": SpecConfig("ngram", 16),
    }
    prompts = sample_workloads(args.workload or ["spec_bench", "editeval"], args.limit, 0)
    rows: list[dict] = []
    for prompt in prompts:
        ids = engine.tokenizer.encode_chat(list(prompt.messages))
        plain = engine.generate(ids, max_tokens=args.max_tokens, spec=SpecConfig("none"))
        for name, spec in specs.items():
            out = engine.generate(ids, max_tokens=args.max_tokens, spec=spec)
            s = out.stats
            passes = max(1, s.target_forward_passes - 1)  # (the prefill's pass drafts nothing)
            rows.append({"category": prompt.category, "method": name,
                         "tokens_per_pass": (s.new_tokens - 1) / passes,
                         "identical": out.token_ids == plain.token_ids})
            print(f"{prompt.category:15s} {name:10s} {rows[-1]['tokens_per_pass']:.2f} "
                  f"tokens/pass, identical {rows[-1]['identical']}", flush=True)
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for cat in [*sorted({r["category"] for r in rows}), "all"]:
        for name in specs:
            got = [r["tokens_per_pass"] for r in rows if r["method"] == name and
                   cat in ("all", r["category"])]
            table[cat][name] = round(statistics.mean(got), 3)
    print(json.dumps(table, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "mean": table},
                                         indent=1))


if __name__ == "__main__":
    main()
