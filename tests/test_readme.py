"""The README's commands cannot rot: every `forerun ...` line of its bash blocks parses with the
real parser (each subcommand, flag and choice exists), a few tour lines run on a tiny model,
its links lead to files that exist, and the README stays a user's page: short, with no
headings named after sessions or dates."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_files import byte_tokens, random_hf_weights, write_hf_dir

from forerun.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
MAX_LINES = 450
SEPARATORS = {"|", "||", "&&", ";", "&"}  # between commands of one line
REDIRECTS = {">", ">>", "<", "2>", "&>"}  # each followed by its file
DATED_HEADING = re.compile(r"session|\b20\d\d-\d\d", re.IGNORECASE)


def bash_lines(text: str) -> list[str]:
    """The lines of the fenced bash blocks, continuation lines (a trailing backslash) joined."""
    lines, block = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
            continue
        if block == "bash":
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return lines


def commands(line: str) -> list[list[str]]:
    """The commands of a shell line: words split as the shell would, comments dropped, split at
    pipes and separators, redirections and their files left out."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    found, words, skip = [], [], False
    for word in lex:
        if skip:
            skip = False
        elif word in SEPARATORS:
            found.append(words)
            words = []
        elif word in REDIRECTS:
            skip = True
        else:
            words.append(word)
    return [c for c in [*found, words] if c]


def readme_commands() -> list[list[str]]:
    return [argv for line in bash_lines(README.read_text()) for argv in commands(line)
            if argv[0] == "forerun"]


def test_the_readme_shows_commands():
    argvs = readme_commands()
    assert len(argvs) >= 10
    assert {"generate", "models", "bench", "serve"} <= {argv[1] for argv in argvs}


@pytest.mark.parametrize("argv", readme_commands(), ids=shlex.join)
def test_every_readme_command_parses(argv):
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit as e:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {e.code})")
    assert callable(args.func)


def test_the_readme_is_for_users():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [h for h in headings if DATED_HEADING.search(h)], "dated or session headings"
    assert "make run" in text and "make test" in text


def test_the_readme_links_to_files_that_exist():
    links = re.findall(r"\]\(([^)#\s]+)", README.read_text())
    missing = [link for link in links if "://" not in link and not (README.parent / link).exists()]
    assert links and not missing


def tour(first_word: str, *words: str) -> list[str]:
    """The README's own command that starts `forerun FIRST_WORD WORDS...`."""
    for argv in readme_commands():
        if argv[1:2 + len(words)] == [first_word, *words]:
            return argv
    raise AssertionError(f"no `forerun {first_word} {' '.join(words)}` in the README")


def run(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"FORERUN_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "forerun.cli", *argv[1:]], capture_output=True,
                          text=True, timeout=300, env=env)


def test_models_list_json_runs_as_shown(tmp_path):
    argv = tour("models", "list")
    r = run([*argv, *([] if "--json" in argv else ["--json"])], tmp_path)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert "qwen2.5-coder-1.5b-instruct" in {row["name"] for row in rows}
    assert not any(row["pulled"] for row in rows)  # an empty FORERUN_HOME


def test_generate_compare_json_runs_as_shown_on_a_tiny_model(tmp_path):
    """The tour's `generate --compare --json` line on a tiny float64 model, prompt lookup
    drafting: the documented keys, and speculative output identical to plain."""
    model = tmp_path / "tiny"
    write_hf_dir(model, random_hf_weights(len(byte_tokens())), byte_tokens())
    argv = [*tour("generate", "--compare"), "--target", str(model), "--method", "ngram",
            "--dtype", "float64", "--max-tokens", "8"]
    r = run(argv, tmp_path / "home")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"plain", "speculative", "speedup", "identical"} <= out.keys()
    assert out["identical"] is True and out["speculative"]["stats"]["method"] == "ngram"
