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
from forerun.bench import serve_peers, serving
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
    assert (tmp_path / "serve-forerun-adaptive.log").exists()


def test_summary_percentiles_and_errors():
    ok = serving.Result(0.5, 2.0, 10, [0.1] * 9)
    slow = serving.Result(1.5, 4.0, 10, [0.3] * 9)
    failed = serving.Result(0.0, 0.1, 0, error="429 busy")
    row = serving.summarize("x", 3, [ok, slow, failed], 4.0, None)
    assert row["errors"] == 1 and row["tokens"] == 20 and row["total_tok_s"] == 5.0
    assert row["ttft_p50_s"] == 1.0 and row["request_tok_s"] == 3.75
    assert row["itl_p50_ms"] == 200.0 and row["first_error"] == "429 busy"


def test_multi_turn_clients_resend_their_history(monkeypatch):
    sent = []

    async def fake(http, model, messages, max_tokens, extra):
        sent.append(messages)
        return serving.Result(0.1, 0.2, 3, text=f"reply {len(sent)}")

    monkeypatch.setattr(serving, "one_request", fake)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    results, _ = serving.level("http://127.0.0.1:9/v1", {}, NAME, prompts, 1, 3, 4,
                               multi_turn=True)
    assert [r.turn for r in results] == [0, 1, 2]
    assert sent[2] == [{"role": "user", "content": PROMPTS[0]},
                       {"role": "assistant", "content": "reply 1"},
                       {"role": "user", "content": PROMPTS[1]},
                       {"role": "assistant", "content": "reply 2"},
                       {"role": "user", "content": PROMPTS[2]}]
    row = serving.summarize("x", 1, results, 1.0, None)
    assert row["ttft_later_turns_p50_s"] == 0.1
    assert serving.summarize("x", 1, results[:1], 1.0, None)["ttft_later_turns_p50_s"] is None


def test_peer_servers_commands_and_skips(tmp_path, monkeypatch):
    gguf, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    python, binary = tmp_path / "python", tmp_path / "llama-server"
    for f in (gguf, draft, python, binary):
        f.write_text("")
    kw = dict(target_gguf=gguf, draft_gguf=draft, k=3, slots=8, context=2048,
              cache=tmp_path / "cache", vllm_model=tmp_path / "hf-t", vllm_draft=tmp_path / "hf-d")
    monkeypatch.delenv(serve_peers.tp.VLLM_VAR, raising=False)
    monkeypatch.delenv(serve_peers.tp.LLAMA_VAR, raising=False)
    made, notes = serve_peers.peer_servers(list(serve_peers.SERVE_PEERS), **kw)
    assert made == [] and len(notes) == 4 and all("is not set" in n for n in notes)
    monkeypatch.setenv(serve_peers.tp.VLLM_VAR, str(python))
    monkeypatch.setenv(serve_peers.tp.LLAMA_VAR, str(binary))
    made, notes = serve_peers.peer_servers(list(serve_peers.SERVE_PEERS), **kw)
    servers = {key: make(1234) for key, make in made}
    assert notes == [] and list(servers) == list(serve_peers.SERVE_PEERS)
    vllm = servers["vllm-draft"].command
    assert vllm[:3] == (str(python), "-m", "vllm.entrypoints.openai.api_server")
    assert json.loads(vllm[vllm.index("--speculative-config") + 1]) == {
        "model": str(tmp_path / "hf-d"), "num_speculative_tokens": 3}
    assert "--speculative-config" not in servers["vllm"].command
    assert dict(servers["vllm"].env)["VLLM_CPU_KVCACHE_SPACE"]
    llama = servers["llama-server-draft"].command
    assert llama[llama.index("-np") + 1] == "8" and llama[llama.index("-c") + 1] == str(8 * 2048)
    assert llama[llama.index("-md") + 1] == str(draft)
    assert "-md" not in servers["llama-server"].command
    assert llama[llama.index("--port") + 1] == "1234"
    _, notes = serve_peers.peer_servers(["llama-server-draft"], **kw | {"draft_gguf": None})
    assert notes == ["llama-server-draft skipped: no draft model"]


HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_peer_server_starts_healthy_and_stops_by_its_pid(tmp_path):
    port = serve_peers.free_port()
    server = serve_peers.PeerServer("fake", (sys.executable, "-c", HEALTHY, str(port)))
    proc, url = serve_peers.start(server, port, tmp_path / "fake.log", timeout=60)
    assert url == f"http://127.0.0.1:{port}/v1" and proc.poll() is None
    serve_peers.stop(proc)
    assert proc.poll() is not None
    broken = serve_peers.PeerServer("broken", (sys.executable, "-c", "print('no model'); exit(3)"))
    try:
        serve_peers.start(broken, port, tmp_path / "broken.log", timeout=60)
    except RuntimeError as e:
        assert "broken exited 3" in str(e) and "no model" in str(e)
    else:
        raise AssertionError("a server that exits must raise")


def test_a_server_that_hangs_up_is_an_error_not_the_end_of_the_bench():
    """A loopback socket that accepts and closes without answering: the request is counted as
    an error (after one retry on a new connection), and the level goes on."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []

    def serve():
        for _ in range(2):
            try:
                conn, _ = listener.accept()
            except OSError:  # closed by the test
                return
            conn.recv(65536)
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    results, _ = serving.level(base, {}, "m", [[{"role": "user", "content": "hi"}]], 1, 1, 4)
    listener.close()
    assert len(results) == 1 and results[0].error  # counted, and the level returned
    # "disconnected without sending a response" is retried once on a new connection (a reset
    # instead, which a loaded machine may report, is not)
    assert len(accepted) == (2 if "without sending" in results[0].error else len(accepted))
