"""Build the long_context workload: Python standard-library sources cut to 2k-16k tokens, each
with a question or a summary to write about it (forerun/bench/workloads/long_context/).

The workload ships no text: each row names a stdlib file (relative to `sysconfig`'s stdlib
directory), the lines to read, and the SHA-256 of those lines, and `forerun.bench.long_context`
renders the prompt at run time (a different Python's file fails the hash, clearly). The lines
are cut where the target's tokenizer counts about the row's context budget (the excerpt's own
tokens; the question and the chat template add ~60). Tasks mix the two MagicDec's paper
benchmarks on long documents: summaries (little to copy) and questions whose answers quote the
code (a rewrite of one function: much to copy).

    python experiments/build_long_context.py [--tokenizer qwen2.5-coder-1.5b-instruct]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

from forerun.bench.long_context import ROWS_FILE, excerpt
from forerun.models.load import open_model

BEFORE_SHARE = 0.7  # of a budget, taken above the function a task names (it ends the excerpt)
BUDGETS = {"ctx_2k": 2048, "ctx_4k": 4096, "ctx_8k": 8192, "ctx_16k": 16384}
# (file, task): each file long enough for the largest budget it is used at
SOURCES = {
    "ctx_2k": [("textwrap.py", "summary"), ("heapq.py", "rewrite:merge"),
               ("json/decoder.py", "question:py_scanstring")],
    "ctx_4k": [("functools.py", "summary"), ("fractions.py", "rewrite:limit_denominator"),
               ("statistics.py", "question:median_grouped")],
    "ctx_8k": [("dataclasses.py", "summary"), ("shutil.py", "rewrite:copytree"),
               ("difflib.py", "question:get_matching_blocks")],
    "ctx_16k": [("argparse.py", "summary"), ("subprocess.py", "rewrite:check_output"),
                ("inspect.py", "question:getsource")],
}
TASKS = {
    "summary": "Summarize the module above for a new maintainer: what it provides, its main "
               "classes and functions, and how they fit together.",
    "rewrite": "Rewrite the function `{name}` from the code above with full type hints and a "
               "Google-style docstring; keep its behaviour and its code otherwise unchanged.",
    "question": "Explain step by step how `{name}` in the code above works, quoting the lines "
                "you refer to.",
}


def cut(lines: list[str], budget: int, count) -> int:
    """The most lines from the top whose text has at most `budget` tokens (bisection)."""
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count("".join(lines[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct",
                   help="the model whose tokenizer counts the budgets")
    args = p.parse_args()
    tokenizer = open_model(args.tokenizer).tokenizer
    stdlib = Path(sysconfig.get_paths()["stdlib"])

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special=False))

    rows = []
    for category, sources in SOURCES.items():
        budget = BUDGETS[category]
        for name, task in sources:
            lines = (stdlib / name).read_text(encoding="utf-8").splitlines(keepends=True)
            kind, _, target = task.partition(":")
            start = 0  # from the top, or with the asked-for function in its last third
            if target:
                at = next(i for i, line in enumerate(lines) if f"def {target}(" in line)
                before = lines[:at][::-1]  # the lines above it, nearest first
                start = at - cut(before, int(budget * BEFORE_SHARE), count) if before else at
            end = start + cut(lines[start:], budget, count)
            if target and not any(f"def {target}(" in line for line in lines[start:end]):
                raise SystemExit(f"{name}: `{target}` is not in lines {start + 1}-{end}")
            row = {"id": f"{Path(name).stem}-{category}", "category": category,
                   "source": name, "lines": [start + 1, end],
                   "question": TASKS[kind].format(name=target)}
            text = excerpt(row, stdlib, check=False)
            row["sha256"] = hashlib.sha256(text.encode()).hexdigest()
            row["tokens"] = len(tokenizer.encode(text, add_special=False))
            rows.append(row)
            print(f"{row['id']:28} {name:20} lines {start + 1:5}-{end:5} {row['tokens']:6} tokens")
    with ROWS_FILE.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} rows -> {ROWS_FILE} (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
