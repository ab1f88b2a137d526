"""`forerun bench serve`, end to end on tiny float64 models: it starts its own forerun server
(and stops it), measures another OpenAI-compatible server given by --base-url (here forerun's
app in a thread of this process), and writes the table, the JSON and the plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_serve import NAME, ThreadServer, model_dirs  # noqa: F401 (fixture)

from forerun import Engine, SpecConfig
from forerun.bench import serving
from forerun.models.load import open_model
from forerun.serve.app import ServeConfig, create_app
from forerun.serve.worker import Worker

PROMPTS = ["Say hi.", "Count to three.", "Name a colour."]


def test_bench_serve_measures_started_and_given_servers(model_dirs, tmp_path):  # noqa: F811
    workload = tmp_path / "chat.jsonl"
    workload.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    src = open_model(str(model_dirs[0]))
    engine = Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer,
                                  spec=SpecConfig("none"))
    with ThreadServer(create_app(Worker(engine, slots=2, max_queue=4),
                                 ServeConfig(NAME))) as other:
        r = subprocess.run(
            [sys.executable, "-m", "forerun.cli", "bench", "serve", "--target",
             str(model_dirs[0]), "--draft", "", "--dtype", "float64", "--methods", "ngram",
             "--ks", "2", "--workload", str(workload), "--limit", "0", "--max-tokens", "4",
             "--concurrency", "1,2", "--requests-per-client", "1", "--spec-policies",
             "adaptive", "--base-url", f"other={other.base}/v1", "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent,
            env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "serve_bench.json").read_text())
    rows = report["rows"]
    assert [(row["config"], row["concurrency"]) for row in rows] == [
        ("forerun adaptive", 1), ("forerun adaptive", 2), ("other", 1), ("other", 2)]
    assert all(row["errors"] == 0 and row["tokens"] > 0 and row["total_tok_s"] > 0
               and row["ttft_p50_s"] > 0 for row in rows)
    assert all(row["peak_rss_gb"] > 0 for row in rows[:2])  # the server it started
    assert all(row["peak_rss_gb"] is None for row in rows[2:])  # no --server-pid given
    assert "total tok/s" in r.stdout and json.loads(r.stdout.splitlines()[-1])["rows"] == rows
    assert (tmp_path / "serve_bench.png").stat().st_size > 0
    assert (tmp_path / "serve-adaptive.log").exists()


def test_summary_percentiles_and_errors():
    ok = serving.Result(0.5, 2.0, 10, [0.1] * 9)
    slow = serving.Result(1.5, 4.0, 10, [0.3] * 9)
    failed = serving.Result(0.0, 0.1, 0, error="429 busy")
    row = serving.summarize("x", 3, [ok, slow, failed], 4.0, None)
    assert row["errors"] == 1 and row["tokens"] == 20 and row["total_tok_s"] == 5.0
    assert row["ttft_p50_s"] == 1.0 and row["request_tok_s"] == 3.75
    assert row["itl_p50_ms"] == 200.0 and row["first_error"] == "429 busy"
