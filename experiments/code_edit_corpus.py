"""A code-edit corpus for `forerun train draft`, in EditEval's row shape, from code that ships
with Python and on PyPI (never from EditEval's rows).

Each row is a short function (5-25 lines) from the standard library or a package installed from
PyPI in this environment (click, jinja2, httpx, ...), with an edit instruction made for it:
rename the function or a parameter, add type hints or a docstring, add an argument, validate an
argument, add logging, make a parameter keyword-only, or fix a bug planted in it (a comparison
or an arithmetic operator flipped, the instruction says which kind). `forerun bench --workload`
and `forerun train draft --questions` read the rows ({"task_id", "instruction", "input"}) as
EditEval's prompt: instruction, the code in a python block, "Reply with the complete edited
code". Functions are taken evenly across the sources, in a fixed order (seeded).

    python experiments/code_edit_corpus.py --rows 240 --out /tmp/code-edits.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
import textwrap
from pathlib import Path

PYPI_PACKAGES = ("click", "jinja2", "httpx", "httpcore", "anyio", "idna", "filelock",
                 "fsspec", "tqdm", "rich", "pydantic", "fastapi", "starlette", "markdown_it",
                 "pygments", "dateutil", "certifi", "charset_normalizer", "h11", "diskcache")
MIN_LINES, MAX_LINES = 5, 25
FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.Add: ast.Sub, ast.Sub: ast.Add}


def sources() -> list[tuple[str, Path]]:
    """(label, file): the standard library's top-level modules, then the PyPI packages' files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    out = [("stdlib", p) for p in sorted(stdlib.glob("*.py"))]
    for package in PYPI_PACKAGES:
        out += [(package, p) for p in sorted((site / package).rglob("*.py"))]
    return out


def functions(path: Path) -> list[tuple[str, ast.FunctionDef]]:
    """(source, node) of every function of MIN_LINES..MAX_LINES lines, dedented."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and MIN_LINES <= node.end_lineno - node.lineno + 1 \
                <= MAX_LINES:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            source = textwrap.dedent("\n".join(lines[start - 1:node.end_lineno]))
            out.append((source, node))
    return out


def plant_bug(source: str, rng: random.Random) -> tuple[str, str] | None:
    """The source with one comparison or +/- flipped, and what kind of bug that is; None if
    it has neither."""
    tree = ast.parse(source)
    spots = [n for n in ast.walk(tree)
             if (isinstance(n, ast.Compare) and type(n.ops[0]) in FLIPS)
             or (isinstance(n, ast.BinOp) and type(n.op) in FLIPS)]
    if not spots:
        return None
    node = rng.choice(spots)
    if isinstance(node, ast.Compare):
        node.ops[0] = FLIPS[type(node.ops[0])]()
        kind = "a comparison is wrong"
    else:
        node.op = FLIPS[type(node.op)]()
        kind = "an arithmetic operator is wrong"
    return ast.unparse(tree), kind


def edit(source: str, node: ast.FunctionDef, rng: random.Random) -> tuple[str, str] | None:
    """(instruction, code) for one function, the kind of edit drawn from those that apply."""
    params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    name = node.name
    choices = ["hints", "docstring", "verbose", "logging"]
    if not name.startswith("_"):
        choices.append("rename")
    if params:
        choices += ["param", "validate", "kwonly"]
    choices += ["bug", "bug"]  # EditEval asks for fixes more than for anything else
    kind = rng.choice(choices)
    if kind == "bug":
        planted = plant_bug(source, rng)
        if planted is None:
            return None
        code, what = planted
        return f"The function `{name}` has a bug: {what}. Fix it.", code
    p = rng.choice(params) if params else ""
    instruction = {
        "hints": "Add type hints to every parameter and to the return value.",
        "docstring": "Add a docstring that explains what the function does, its arguments "
                     "and its return value.",
        "verbose": "Add an optional keyword argument `verbose: bool = False`; when it is true, "
                   "print the arguments before doing anything else.",
        "logging": "Log each call's arguments at debug level with a module-level logger "
                   "(`logger = logging.getLogger(__name__)`).",
        "rename": f"Rename the function `{name}` to `{name}_checked` and update any "
                  "recursive calls.",
        "param": f"Rename the parameter `{p}` to `{p}_value` everywhere in the function.",
        "validate": f"Raise a ValueError with a clear message when `{p}` is None.",
        "kwonly": f"Make `{p}` a keyword-only parameter.",
    }[kind]
    return instruction, source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    pool = [(label, path, f) for label, path in sources() for f in functions(path)]
    rng.shuffle(pool)
    rows, seen = [], set()
    for label, path, (source, node) in pool:
        if len(rows) >= args.rows:
            break
        if source in seen:
            continue
        made = edit(source, node, rng)
        if made is None:
            continue
        seen.add(source)
        instruction, code = made
        rows.append({"task_id": f"{label}/{path.stem}.{node.name}", "instruction": instruction,
                     "input": code})
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels = {r["task_id"].split("/")[0] for r in rows}
    print(f"wrote {len(rows)} rows to {args.out} from {len(labels)} sources "
          f"({len(pool)} functions)")


if __name__ == "__main__":
    main()
