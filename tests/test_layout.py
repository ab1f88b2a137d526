"""The tree's shape, as STYLE.md asks for it: the CLI is on top and nothing imports it back, a
command module imports the library and the shared options only, the library has no import
circles, files stay readable, and every module says what it owns."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "forerun"
MAX_LINES = 550
# files over MAX_LINES, each with its reason; new ones are split instead of listed here
LONG_FILES = {
    "runtime/llama_cpp.py",  # llama.cpp's C API in one place: batch building, KV cache, hidden rows
}


def modules() -> dict[str, Path]:
    """Every module under forerun/ by dotted name (namespace packages too)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, top_level_only: bool = False) -> set[str]:
    """The forerun modules `name` imports (lazy imports in functions too, unless
    `top_level_only`); `from package import module` counts as the module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    known = modules()
    return {m for m in found if m in known and m != name}


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_nothing_imports_the_cli_and_commands_import_no_other_command():
    for name, path in modules().items():
        deps = imported(name, path)
        front = {d for d in deps if d == "forerun.cli" or d.startswith("forerun.commands")}
        if name == "forerun.cli":
            continue
        if name.startswith("forerun.commands"):
            allowed = {"forerun.commands", "forerun.commands.options"}
            if name == "forerun.commands":  # the list of commands imports each of them
                continue
            assert front <= allowed, f"{name} imports {sorted(front - allowed)}"
        else:
            assert not front, f"{name} (library) imports {sorted(front)}"


def test_no_import_circle_at_module_level():
    graph = {name: imported(name, path, top_level_only=True)
             for name, path in modules().items()}
    # a package's __init__ re-exporting its modules is not a circle with them
    for name in graph:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import circle: " + " -> ".join([*stack[stack.index(node):],
                                                                   node]))
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_files_stay_readable():
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    long = {f for f, n in lines.items() if n > MAX_LINES}
    assert long <= LONG_FILES, {f: lines[f] for f in long - LONG_FILES}
    assert set(lines) >= LONG_FILES, "a listed file is gone: drop it from LONG_FILES"


def test_every_module_has_a_docstring():
    missing = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
               if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, missing


# getattr/hasattr on objects that are not forerun's own, each with its reason. What a proposer
# needs and what a runtime can do are declared (`Needs`, `Capabilities`), never probed: a new
# probe of our own objects fails here, to be declared in a record instead.
LIBRARY_PROBES = ("torch",)  # feature probes of the installed torch (ops, dtypes)
FOREIGN_PROBES = {
    ("runtime/llama_cpp.py", "lib"): "the llama.cpp library: does this build have our patch",
    ("models/chat_template.py", "func"): "the template sandbox: Jinja's marks on a callable",
    ("models/chat_template.py", "__obj"): "the template sandbox: what a template calls",
    ("models/chat_template.py", "bound"): "the template sandbox: what a template calls",
    ("bench/heads_cost.py", "self.inner"): "TimedProposer, a proxy: all but propose is inner's",
    ("check.py", "verify_phase"): "the self-test swaps the verify phase's samplers, restores them",
    ("bench/throughput_peers.py", "tok"): "a Hugging Face tokenizer's chat template",
}


def test_no_probing_of_our_own_objects():
    probes = []
    for path in sorted(ROOT.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                obj = ast.unparse(node.args[0])
                if obj.split(".")[0] not in LIBRARY_PROBES and (name, obj) not in FOREIGN_PROBES:
                    probes.append(f"{name}:{node.lineno}: {node.func.id}({obj}, ...)")
    assert not probes, "declare it (Needs, Capabilities) instead of probing:\n" + "\n".join(
        probes)
