"""The training corpus: the questions the target answers and the texts it is teacher-forced on.

Owns: the written question sets (`prompts.json`, shipped with the package; appended to, never
reordered, so that collected replies keep their place), `chat_prompts()` built from them and
from the Python standard library's sources on this machine, the user's own `--questions` and
`--text` files, and cutting texts into token windows. No model runs here: `collection` has the
target answer and teacher-force these.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from collections.abc import Iterator
from importlib.resources import files as package_files
from pathlib import Path

# the question sets, written for forerun (none is a benchmark row): `chat_prompts` (the first
# 32), then the families chat_prompts() combines; the Magpie openers and the passage tasks of
# `collection`. The second set (after the first 138): writing, role play, reasoning, science
# and humanities, factual questions, translation from German and French, word problems,
# summaries and questions on a passage, more code. The third (after the first 390): the same
# families in other combinations, and more facts.
PROMPTS: dict[str, list] = json.loads(
    package_files("forerun.train").joinpath("prompts.json").read_text(encoding="utf-8"))
CHAT_PROMPTS: tuple[str, ...] = tuple(PROMPTS["chat_prompts"])
EXPLAIN, SENTENCES, LANGUAGES, EDITS = (tuple(PROMPTS[k]) for k in (
    "explain", "sentences", "languages", "edits"))
TASKS, MORE_TASKS = (tuple(map(tuple, PROMPTS[k])) for k in ("tasks", "more_tasks"))  # (lang, task)
FORMS, SUBJECTS, ROLES, ROLE_QUESTIONS, CONCEPTS = (tuple(PROMPTS[k]) for k in (
    "forms", "subjects", "roles", "role_questions", "concepts"))
FACTS, MORE_FACTS, GERMAN, FRENCH = (tuple(PROMPTS[k]) for k in (
    "facts", "more_facts", "german", "french"))
PROBLEMS, PASSAGE_ASKS = tuple(PROMPTS["problems"]), tuple(PROMPTS["passage_asks"])  # {a} {b}
OTHER_LANGUAGES = tuple(PROMPTS["other_languages"])
SELF_OPENERS = tuple(PROMPTS["self_openers"])  # how the target's own questions start, in turn
PASSAGE_OPENERS = tuple(PROMPTS["passage_openers"])  # requests for a passage of its own
TASK_TEMPLATES = tuple(PROMPTS["task_templates"])  # a question around a passage ({passage})


@functools.cache
def chat_prompts() -> tuple[str, ...]:
    """CHAT_PROMPTS, then generated ones in a fixed order: explanations, code, translations,
    arithmetic, summaries of the standard library's module docstrings and edits of its short
    functions (as a user would paste them). Parses the standard library (seconds): cached."""
    import ast

    out = list(CHAT_PROMPTS)
    out += [f"Explain {topic} in a few sentences." for topic in EXPLAIN]
    out += [f"Write a {lang} function that {task}." for lang, task in TASKS]
    out += [f"Translate into {LANGUAGES[i % len(LANGUAGES)]}: {s}"
            for i, s in enumerate(SENTENCES * 2)]
    out += [f"A shop sells {a} pens for ${b}. How much do {c} pens cost? Show the steps."
            for a, b, c in ((3, 4, 9), (5, 12, 7), (4, 10, 22), (6, 15, 10))]
    docs, functions = [], []
    for text in code_corpus():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        doc = ast.get_docstring(tree)
        if doc and 200 <= len(doc) <= 1200:
            docs.append(doc)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno <= 14:
                functions.append(ast.get_source_segment(text, node))
    out += [f"Summarize this documentation in two sentences:\n\n{d}" for d in docs[::3][:16]]
    out += [f"Please {EDITS[i % len(EDITS)]} for this function:\n\n```python\n{f}\n```"
            for i, f in enumerate(functions[::17][:32])]
    # the second set: appended, so that the first prompts (and collected replies) keep their place
    out += [f"Write {FORMS[i % len(FORMS)]} about {SUBJECTS[(i * 3) % len(SUBJECTS)]}."
            for i in range(40)]
    out += [f"Pretend to be {ROLES[i % len(ROLES)]} in this conversation and answer as they "
            f"would: {ROLE_QUESTIONS[(i * 5) % len(ROLE_QUESTIONS)]}" for i in range(20)]
    out += [f"In a few paragraphs, what is {c}, and why does it matter?" for c in CONCEPTS]
    out += list(FACTS)
    out += [f"Translate German to English: {g}" for g in GERMAN]
    out += [f"Translate French to English: {f}" for f in FRENCH]
    out += [PROBLEMS[i % len(PROBLEMS)].format(a=3 + (i * 7) % 11, b=2 + (i * 5) % 9)
            for i in range(36)]
    out += [f"Write a {lang} function that {task}." for lang, task in MORE_TASKS]
    out += [f"Summarize: {d}" for d in docs[1::3][:40]]
    out += [f"{d}\n\n{PASSAGE_ASKS[i % len(PASSAGE_ASKS)]}" for i, d in enumerate(docs[2::3][:40])]
    out += [f"Please {EDITS[i % len(EDITS)]} for this function:\n\n```python\n{f}\n```"
            for i, f in enumerate(functions[5::17][:40])]
    # the third set, appended for the same reason
    out += [f"Explain {topic} to a beginner, with one concrete example." for topic in EXPLAIN]
    out += [f"Explain {c} to a ten-year-old." for c in CONCEPTS]
    out += [f"Give three real-world examples of {c}, one sentence each." for c in CONCEPTS]
    tasks = TASKS + MORE_TASKS
    out += [f"Write a {lang} function that {task}."
            for i, (first, task) in enumerate(tasks)
            for lang in [other_language(i, first)]]
    out += [f"Write pytest unit tests for a Python function that {task}."
            for lang, task in tasks if lang == "Python"]
    paired = {(i % len(FORMS), (i * 3) % len(SUBJECTS)) for i in range(40)}
    out += [f"Write {FORMS[f]} about {SUBJECTS[t]}." for t in range(len(SUBJECTS))
            for f in range(len(FORMS)) if (f, t) not in paired][:60]
    paired = {(i % len(ROLES), (i * 5) % len(ROLE_QUESTIONS)) for i in range(20)}
    out += [f"Pretend to be {ROLES[r]} in this conversation and answer as they would: "
            f"{ROLE_QUESTIONS[q]}" for q in range(len(ROLE_QUESTIONS))
            for r in range(len(ROLES)) if (r, q) not in paired][:40]
    out += list(MORE_FACTS)
    paired = {(i % len(LANGUAGES), i % len(SENTENCES)) for i in range(2 * len(SENTENCES))}
    out += [f"Translate into {LANGUAGES[g]}: {SENTENCES[t]}" for t in range(len(SENTENCES))
            for g in range(len(LANGUAGES)) if (g, t) not in paired]
    out += [PROBLEMS[i % len(PROBLEMS)].format(a=3 + (i * 7) % 11, b=2 + (i * 5) % 9)
            for i in range(36, 96)]
    out += [f"Explain what this module does, for a new contributor:\n\n{d}"
            for d in docs[::3][16:56]]
    out += [f"Explain what this function does, step by step:\n\n```python\n{f}\n```"
            for f in functions[9::17][:40]]
    out += [f"Write unit tests for this function:\n\n```python\n{f}\n```"
            for f in functions[13::17][:30]]
    return tuple(out)


def user_questions(paths: tuple[str, ...]) -> tuple[str, ...]:
    """--questions files -> their prompts (first user turns), in file order: any JSONL shape
    `forerun bench --workload` reads. The bench's own prompt sets are refused: a head trained on
    them would flatter every figure `forerun bench` prints."""
    from forerun.bench.workloads import BUILTIN, read_workload

    bundled = {path.resolve() for path in BUILTIN.values()}
    out: list[str] = []
    for name in paths:
        path = Path(name).expanduser()
        if name in BUILTIN or (path.is_file() and path.resolve() in bundled):
            raise ValueError(f"--questions {name}: that is one of `forerun bench`'s own prompt "
                             "sets; a head trained on it would flatter the bench. Give prompts "
                             "of your own traffic.")
        out += [p.text for p in read_workload(str(path))]
    return tuple(out)


def other_language(i: int, first: str) -> str:
    """OTHER_LANGUAGES[i], cyclically, or the next one where that is `first`."""
    n = len(OTHER_LANGUAGES)
    return OTHER_LANGUAGES[(i + (OTHER_LANGUAGES[i % n] == first)) % n]


# --- texts ----------------------------------------------------------------------------------------

def read_texts(paths: list[Path]) -> Iterator[str]:
    """The files' UTF-8 texts, in order; unreadable or non-UTF-8 files are skipped."""
    for path in paths:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def code_corpus() -> Iterator[str]:
    """The standard library's top-level sources, in a fixed order."""
    return read_texts(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


TEXT_SUFFIXES = (".txt", ".md", ".rst")  # what a --text folder contributes (".rst.txt" too)


def text_files(paths: tuple[str, ...]) -> list[Path]:
    """--text paths -> the files they name, in a fixed order: a file as given, a folder's files
    with TEXT_SUFFIXES (recursively, sorted). A missing path or an empty folder is an error."""
    files: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
            if not found:
                raise ValueError(f"--text {name}: no {'/'.join(TEXT_SUFFIXES)} files in it")
            files += found
        else:
            raise ValueError(f"--text {name}: no such file or folder")
    return files


def chunked(tok, texts: Iterator[str], n: int) -> Iterator[list[int]]:
    """Texts tokenized back to back, cut into windows of n tokens (a short tail is dropped)."""
    buffer: list[int] = []
    for text in texts:
        buffer += tok.encode(text, add_special=False)
        while len(buffer) >= n:
            yield buffer[:n]
            buffer = buffer[n:]
