"""The throughput peers without the peers: skipping when their variables are unset or wrong, and
the subprocess round trip on stand-ins (a fake python printing canned JSON, a fake llama-server
answering on loopback). No vLLM or llama.cpp here."""

import sys
from pathlib import Path

import pytest

from forerun.bench import throughput_peers as tp

CANNED = {"total_tokens": 6, "wall_s": 2.0, "tok_s": 3.0, "per_seq_tok_s": 1.5,
          "token_ids": [[1, 2, 3], [4, 5, 6]]}


def fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for a peer env's python (`python -c SCRIPT`, payload on stdin);
    laid out as a venv's bin/python, with the venv's lib/ beside it."""
    (tmp_path / "env" / "lib").mkdir(parents=True)
    exe = tmp_path / "env" / "bin" / "python"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
    exe.chmod(0o755)
    return exe


def test_peers_are_skipped_with_a_note_when_their_variables_are_unset(monkeypatch, tmp_path):
    monkeypatch.delenv(tp.VLLM_VAR, raising=False)
    monkeypatch.delenv(tp.LLAMA_VAR, raising=False)
    vllm, note = tp.VllmOffline.from_env(tmp_path)
    assert vllm is None and tp.VLLM_VAR in note and "not set" in note
    server, note = tp.LlamaServerPeer.from_env(tmp_path / "m.gguf")
    assert server is None and tp.LLAMA_VAR in note and "not set" in note


def test_peers_are_skipped_when_their_paths_are_missing(monkeypatch, tmp_path):
    monkeypatch.setenv(tp.VLLM_VAR, str(tmp_path / "nope" / "python"))
    monkeypatch.setenv(tp.LLAMA_VAR, str(tmp_path / "llama-server"))
    assert tp.VllmOffline.from_env(tmp_path)[0] is None
    server, note = tp.LlamaServerPeer.from_env(tmp_path / "m.gguf")
    assert server is None and "does not exist" in note


def test_vllm_offline_reads_the_result_line_among_logs(monkeypatch, tmp_path):
    python = fake_python(tmp_path, (
        "a = json.load(sys.stdin)\n"
        "assert sys.argv[1] == '-c' and 'LLM(' in sys.argv[2]\n"
        "print('INFO some vllm log line')\n"
        f"r = {CANNED!r}\n"
        "r['seen'] = {'prompts': a['prompts'], 'max_tokens': a['max_tokens'], 'k': a['k'],\n"
        "             'draft': a['draft'], 'kv': os.environ['VLLM_CPU_KVCACHE_SPACE'],\n"
        "             'preload': os.environ.get('LD_PRELOAD', '')}\n"
        "print('FORERUN_RESULT ' + json.dumps(r))\n"
        "print('INFO shutting down')"))
    (python.parent.parent / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv(tp.VLLM_VAR, str(python))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    peer, note = tp.VllmOffline.from_env(tmp_path / "target", tmp_path / "draft", k=3)
    assert peer is not None and note == "" and peer.label() == "vllm draft k=3"
    out = peer.run(["a", "b"], 8)
    seen = out.pop("seen")
    assert out == CANNED
    assert seen == {"prompts": ["a", "b"], "max_tokens": 8, "k": 3,
                    "draft": str(tmp_path / "draft"), "kv": str(tp.KV_CACHE_GB),
                    "preload": str(python.parent.parent / "lib" / "libiomp5.so")}


def test_a_failing_or_silent_peer_raises_with_its_output(tmp_path):
    python = fake_python(tmp_path, "print('boom', file=sys.stderr); sys.exit(3)")
    with pytest.raises(RuntimeError, match="exited 3 with no result line:\nboom"):
        tp.VllmOffline(python, tmp_path).run(["a"], 4)
    python.write_text(f"#!{sys.executable}\nprint('no result here')\n")
    with pytest.raises(RuntimeError, match="exited 0 with no result line:\nno result here"):
        tp.VllmOffline(python, tmp_path).run(["a"], 4)
    python.write_text(f"#!{sys.executable}\nprint('FORERUN_RESULT {{\"tok_s\": 1}}')\n"
                      "raise SystemExit(1)\n")  # a shutdown that fails after the result
    assert tp.VllmOffline(python, tmp_path).run(["a"], 4) == {"tok_s": 1}


def test_hf_dir_from_gguf_runs_in_the_peer_python_and_keeps_a_made_folder(tmp_path):
    python = fake_python(tmp_path, (
        "a = json.load(sys.stdin)\n"
        "assert 'gguf_file' in sys.argv[2]\n"
        "os.makedirs(a['out'])\n"
        "for f in ('model.safetensors', 'config.json'):\n"
        "    open(os.path.join(a['out'], f), 'w').close()\n"
        "print('FORERUN_RESULT ' + json.dumps({'out': a['out'], 'tensors': 1}))"))
    out = tmp_path / "hf"
    assert tp.hf_dir_from_gguf(tmp_path / "m.gguf", out, python) == out
    python.write_text(f"#!{sys.executable}\nraise SystemExit(1)\n")  # not run again
    assert tp.hf_dir_from_gguf(tmp_path / "m.gguf", out, python) == out


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
assert args[args.index("-np") + 1] == "2" and "-md" in args

class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        self.reply({"status": "ok"})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0.0
        text = req["messages"][0]["content"].upper()
        self.reply({"choices": [{"message": {"content": text}}],
                    "usage": {"completion_tokens": req["max_tokens"]}})

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_llama_server_peer_starts_sends_concurrently_and_stops(tmp_path):
    pytest.importorskip("httpx")
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    peer = tp.LlamaServerPeer(binary, tmp_path / "t.gguf", tmp_path / "d.gguf", parallel=2, k=5)
    assert peer.label() == "llama-server -np 2 -md k=5"
    assert peer.command(1234)[peer.command(1234).index("--spec-draft-n-max") + 1] == "5"
    out = peer.run(["ab", "cd", "ef"], 7)
    assert out["total_tokens"] == 21 and out["tokens"] == [7, 7, 7]
    assert out["texts"] == ["AB", "CD", "EF"]
    assert out["tok_s"] > 0 and out["per_seq_tok_s"] > 0 and out["wall_s"] > 0
