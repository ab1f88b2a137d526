"""`forerun bench structured` and `forerun bench processors` (issue 42) on tiny GGUF models:
the PyPI-metadata workload loads, every row's schema compiles with forerun.grammar and its
expected object conforms to it; outputs are scored as the docs say (strict JSON, a fence taken
off, fields right); both modes run end to end in seconds and write their table, JSON (with the
fields the results doc quotes), plot and last-line JSON summary; greedy float64 speculation
reproduces plain decoding in both modes, and every schema output is valid JSON for its schema."""

import json

import pytest
from test_bench import pair  # noqa: F401  (fixture: a tiny target and a draft)
from tiny_files import byte_tokens

from forerun import cli
from forerun.bench.processor_cost import CONFIGS, FAST
from forerun.bench.structured import (
    MODES,
    PLAIN,
    SCORED_FIELDS,
    WORKLOAD,
    Run,
    Task,
    conforms,
    read_tasks,
    sample_tasks,
    score,
)
from forerun.bench.workloads import WorkloadError, read_workload
from forerun.grammar import Grammar, GrammarState, tokenizer_for
from forerun.models.load import open_model

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                                 "n": {"type": "integer"}},
                "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"id": f"t{i}", "prompt": f"name: ab{i}, n: {i}. JSON:", "schema": SMALL_SCHEMA,
             "expected": {"name": f"ab{i}", "n": i}} for i in range(2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pypi_workload_loads_and_every_schema_compiles(pair):  # noqa: F811
    tasks = read_tasks()
    assert len(tasks) == 56 and len({t.id for t in tasks}) == 56
    assert tasks[0].id == "requests-2.32.3" and "Requires-Dist: idna" in tasks[0].messages[0][
        "content"]
    tok = open_model(str(pair[0])).tokenizer  # the byte-level tokenizer llguidance reads
    vocab = len(byte_tokens())
    for task in tasks:
        assert isinstance(task.grammar, Grammar) and task.grammar.compiled()
        GrammarState(task.grammar, tokenizer_for(tok, vocab), vocab)  # raises if it fails
        assert conforms(task.expected, task.schema), task.id
        assert set(SCORED_FIELDS) <= set(task.expected)
    assert len(read_workload(str(WORKLOAD))) == 56  # also a plain `prompt` workload
    assert sample_tasks(tasks, 5, 0) == sample_tasks(tasks, 5, 0) != sample_tasks(tasks, 5, 1)
    assert len(sample_tasks(tasks, 5, 0)) == 5


def test_bad_structured_workloads_fail_clearly(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "no schema"}) + "\n")
    with pytest.raises(WorkloadError, match="needs 'schema'"):
        read_tasks(bad)
    with pytest.raises(WorkloadError, match="no such file"):
        read_tasks(tmp_path / "missing.jsonl")


def test_scoring():
    task = Task("t", ({"role": "user", "content": "x"},), SMALL_SCHEMA,
                {"name": "a_b", "n": 3, "requires_python": None, "dependencies": ["X.y"],
                 "version": "1"})

    def scored(text):
        return score(Run("t", "free", PLAIN, 1, 1, 1.0, 0.1, 0.1, 0, 0, 0, text), task)

    strict = scored('{"name": "a-b", "n": 3}')
    assert strict.valid and strict.valid_fenced
    fenced = scored('```json\n{"name": "a-b", "n": 3}\n```')
    assert not fenced.valid and fenced.valid_fenced
    wrong = scored('{"name": "a-b", "n": "3"}')  # a string where an integer belongs
    assert not wrong.valid and not wrong.valid_fenced
    assert not scored('{"name": "ab", "n": 3, "extra": 1}').valid
    assert not scored('{"name": "ab"').valid and scored("nonsense").fields_right == 0
    # names compare normalized; a missing key is wrong, a null where None is expected right
    assert scored('{"name": "A.B", "n": 3, "version": "1", "dependencies": ["x-Y"]}'
                  ).fields_right == 0.75
    assert scored('{"name": "A.B", "version": "1", "dependencies": ["x-Y"], '
                  '"requires_python": null}').fields_right == 1.0
    assert not conforms(True, {"type": "integer"}) and conforms(None, {"type": ["string",
                                                                                "null"]})


def test_structured_bench_end_to_end(pair, workload, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    assert cli.main(["bench", "structured", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--workload", str(workload), "--max-tokens", "12", "--dtype", "float64",
                     "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    last = json.loads(stdout.strip().splitlines()[-1])
    assert set(last["t1"]) == {"draft k=4"}  # --methods defaults to draft for this mode
    assert {"free_speedup", "schema_speedup", "schema_over_free", "t1_met",
            "decode_schema_over_free"} == set(
        last["t1"]["draft k=4"])
    assert "forerun bench structured" in stdout and "tok/pass" in stdout
    results = json.loads((out / "structured.json").read_text())
    cells = {(c["mode"], c["label"]): c for c in results["cells"]}
    assert set(cells) == {(m, lb) for m in MODES for lb in (PLAIN, "draft k=4")}
    for c in cells.values():
        assert c["prompts"] == 2 and c["tok_s"] > 0 and c["accepted_per_pass"] >= 1
        assert {"speedup", "decode_speedup", "acceptance", "drafted_per_pass", "valid",
                "valid_fenced",
                "fields_right", "identical"} <= set(c)
    assert cells["schema", PLAIN]["speedup"] == 1.0
    # float64 tiny models: greedy speculation reproduces plain decoding, free and schema alike
    assert cells["free", "draft k=4"]["identical"] == cells["schema", "draft k=4"]["identical"] == 1
    schema_runs = [r for r in results["runs"] if r["mode"] == "schema"]
    assert len(results["runs"]) == 2 * 4 and all(r["new_tokens"] > 0 for r in schema_runs)
    t1 = results["t1"]["draft k=4"]
    assert t1["schema_over_free"] == pytest.approx(t1["schema_speedup"] / t1["free_speedup"])
    assert (out / "structured.png").stat().st_size > 1000


def test_schema_outputs_are_valid_when_they_finish(pair, workload, tmp_path, capsys):  # noqa: F811
    """Under the schema every output that ends before max_tokens is valid JSON for it."""
    out = tmp_path / "long"
    assert cli.main(["bench", "structured", "--target", str(pair[0]), "--draft", str(pair[1]),
                     "--workload", str(workload), "--max-tokens", "40", "--dtype", "float64",
                     "--methods", "ngram", "--ks", "3", "--out", str(out)]) == 0
    capsys.readouterr()
    runs = json.loads((out / "structured.json").read_text())["runs"]
    done = [r for r in runs if r["mode"] == "schema" and r["new_tokens"] < 40]
    assert done and all(r["valid"] for r in done)


def test_processors_bench(pair, workload, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "proc"
    assert cli.main(["bench", "processors", "--target", str(pair[0]), "--workload",
                     str(workload), "--max-tokens", "10", "--dtype", "float64", "--repeats",
                     "2", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    last = json.loads(stdout.strip().splitlines()[-1])
    assert set(last["per_token_vs_fast_path"]) == set(CONFIGS) and "t2_met" in last
    assert last["per_token_vs_fast_path"][FAST] == 1.0
    results = json.loads((out / "processors.json").read_text())
    assert {r["config"] for r in results["rows"]} == set(CONFIGS)
    assert len(results["runs"]) == 2 * len(CONFIGS)  # the median of 2 repeats kept per config
    plain = {r["label"]: r["token_ids"] for r in results["runs"] if r["task_id"] == "t0"}
    assert plain["batch step"] == plain[FAST]  # the batch step decodes what the fast path does
    assert results["meta"]["processing"]["repetition_penalty"] > 1
    assert (out / "processors.png").stat().st_size > 1000
