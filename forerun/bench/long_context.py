"""The long_context workload: Python standard-library sources of 2k-16k tokens, each with a
question or a summary to write (MagicDec's setting: a long document, a short answer).

Owns: rendering its rows (`workloads/long_context/documents.jsonl`, built by
experiments/build_long_context.py) into prompts at run time. A row names a stdlib file
relative to this Python's stdlib directory, the lines to read and their SHA-256, so the package
ships no text; another Python's file fails the hash with a clear error. `render` writes the
prompts in the bench's plain {"prompt", "category", "id"} shape, which `forerun bench
--workload PATH` reads. Never tokenizes.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from pathlib import Path

ROWS_FILE = Path(__file__).parent / "workloads" / "long_context" / "documents.jsonl"
PROMPT = ("Here is the Python module `{source}` (lines {first}-{last}):\n\n```python\n{code}```"
          "\n\n{question}")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def excerpt(row: dict, stdlib: Path | None = None, check: bool = True) -> str:
    """The row's lines of its stdlib file; with `check`, verified against its SHA-256."""
    path = (stdlib or stdlib_dir()) / row["source"]
    first, last = row["lines"]
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)[first - 1:last]
    text = "".join(lines)
    if check and hashlib.sha256(text.encode()).hexdigest() != row["sha256"]:
        raise ValueError(f"long_context {row['id']}: {path} lines {first}-{last} are not the "
                         "text the workload was built from (another Python version?); rebuild "
                         "it with experiments/build_long_context.py")
    return text


def rows(categories: list[str] | None = None) -> list[dict]:
    """The workload's rows, those of `categories` only when given (ctx_2k, ctx_4k, ...)."""
    every = [json.loads(line) for line in ROWS_FILE.read_text().splitlines() if line.strip()]
    return [r for r in every if categories is None or r["category"] in categories]


def prompt_text(row: dict, stdlib: Path | None = None) -> str:
    first, last = row["lines"]
    return PROMPT.format(source=row["source"], first=first, last=last,
                         code=excerpt(row, stdlib), question=row["question"])


def render(out: Path, categories: list[str] | None = None) -> int:
    """Write the prompts as the bench's plain JSONL shape to `out` -> how many."""
    selected = rows(categories)
    with out.open("w") as f:
        for row in selected:
            f.write(json.dumps({"id": row["id"], "category": row["category"],
                                "prompt": prompt_text(row)}) + "\n")
    return len(selected)
