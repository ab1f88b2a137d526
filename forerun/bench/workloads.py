"""Benchmark workloads: public prompt sets turned into chat messages, grouped by category.

Owns: reading the JSONL shapes we know (Spec-Bench questions, EditEval instructed edits,
conversations {"messages": [...], "category": ...}, and a plain {"prompt": ..., "category": ...}
shape), the category grouping (Spec-Bench's 8 MT-bench categories become one `mt_bench` group,
as in the Spec-Bench paper) and seeded sampling of `limit` prompts per category. A conversation
becomes one prompt per user turn, in order, each with every earlier turn in its messages; a
category of conversations is sampled by whole conversations (in a seeded order, each one's
turns in order, the last one cut at `limit`), so what a turn repeats from earlier ones is in
the run before it. The public sets ship inside the package with their licenses
(`forerun/bench/workloads/*/LICENSE.upstream`, provenance in SOURCE.md). Never tokenizes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).parent / "workloads"
BUILTIN = {
    "spec_bench": DATA_DIR / "spec_bench" / "question.jsonl",
    "editeval": DATA_DIR / "editeval" / "edit_eval.jsonl",
    "agentic": DATA_DIR / "agentic" / "conversations.jsonl",
}
ROLES = frozenset({"system", "user", "assistant"})
MT_BENCH_CATEGORIES = frozenset({"writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities"})
EDIT_PROMPT = ("{instruction}\n\n```python\n{code}\n```\n\n"
               "Reply with the complete edited code in one ```python block.")


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: tuple[dict, ...]  # chat messages ({"role": "user", "content": ...}), ending
    # with the user turn to answer (earlier turns before it, for a conversation's later turns)
    conversation: str | None = None  # the conversation it is a turn of (None: a lone prompt)

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


class WorkloadError(ValueError):
    pass


def _conversation(row: dict, line: int, default_category: str) -> list[Prompt]:
    """One prompt per user turn: the messages up to and including it."""
    messages, cid = row["messages"], str(row.get("id", line))
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages):
        raise WorkloadError(f"line {line}: messages must be a list of {{'role': one of "
                            f"{sorted(ROLES)}, 'content': str}}")
    turns = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not turns:
        raise WorkloadError(f"line {line}: a conversation with no user turn")
    category = str(row.get("category", default_category))
    return [Prompt(f"{cid}/{n}", category, tuple(messages[:i + 1]), cid)
            for n, i in enumerate(turns, 1)]


def _from_row(row: dict, line: int, default_category: str) -> Prompt:
    if "turns" in row:  # Spec-Bench / MT-bench: first turn only
        category = row.get("category", default_category)
        category = "mt_bench" if category in MT_BENCH_CATEGORIES else category
        text, pid = row["turns"][0], row.get("question_id", line)
    elif "instruction" in row and "input" in row:  # EditEval
        category = row.get("category", "editeval")
        text = EDIT_PROMPT.format(instruction=row["instruction"].strip(), code=row["input"])
        pid = row.get("task_id", line)
    elif "prompt" in row:
        category, text, pid = row.get("category", default_category), row["prompt"], row.get(
            "id", line)
    else:
        raise WorkloadError(f"line {line}: expected 'turns' (Spec-Bench), 'instruction' + "
                            f"'input' (EditEval) or 'prompt'; got keys {sorted(row)}")
    if not isinstance(text, str) or not text.strip():
        raise WorkloadError(f"line {line}: empty prompt")
    return Prompt(str(pid), str(category), ({"role": "user", "content": text},))


def read_workload(source: str) -> list[Prompt]:
    """All prompts of a built-in workload name or a JSONL file, in file order."""
    path = BUILTIN.get(source, Path(source))
    if not path.is_file():
        raise WorkloadError(f"workload {source!r}: no such file; use {', '.join(BUILTIN)} or a "
                            "JSONL path")
    prompts = []
    default_category = path.stem
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{n}: not JSON ({e.msg})") from e
        if "messages" in row:
            prompts.extend(_conversation(row, n, default_category))
        else:
            prompts.append(_from_row(row, n, default_category))
    if not prompts:
        raise WorkloadError(f"{path}: no prompts")
    return prompts


def split_limit(source: str, limit: int | None) -> tuple[str, int | None]:
    """"editeval:40" -> ("editeval", 40): a per-workload limit overrides the common one."""
    name, sep, n = source.rpartition(":")
    if sep and n.isdigit() and name:
        return name, int(n) or None
    return source, limit


def sample_workloads(sources: list[str], limit: int | None, seed: int) -> list[Prompt]:
    """Up to `limit` prompts per category (a seeded sample), categories in first-seen order.
    A source may carry its own limit as NAME:N."""
    by_category: dict[str, list[Prompt]] = {}
    limits: dict[str, int | None] = {}
    for source in sources:
        path, source_limit = split_limit(source, limit)
        for p in read_workload(path):
            by_category.setdefault(p.category, []).append(p)
            limits[p.category] = source_limit
    chosen = []
    for category, prompts in by_category.items():
        rng, n = random.Random(f"{seed}:{category}"), limits[category]
        if n is None:
            chosen.extend(prompts)
        elif any(p.conversation is not None for p in prompts):
            chosen.extend(_whole_conversations(prompts, n, rng))
        else:
            chosen.extend(rng.sample(prompts, min(n, len(prompts))))
    return chosen


def _whole_conversations(prompts: list[Prompt], n: int, rng: random.Random) -> list[Prompt]:
    """The first n prompts of the conversations taken in a seeded order, each one's in order."""
    by_id: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_id.setdefault(p.conversation or p.id, []).append(p)
    order = list(by_id)
    rng.shuffle(order)
    return [p for cid in order for p in by_id[cid]][:n]
