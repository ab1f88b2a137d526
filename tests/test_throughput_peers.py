"""The throughput peers without the peers: skipping when their variables are unset or wrong, and
the subprocess round trip on stand-ins (a fake python printing canned JSON, the real vLLM script
on a fake `vllm` package, a fake llama-server answering on loopback). No vLLM or llama.cpp here."""

import json
import subprocess
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


def test_vllm_offline_reads_each_batch_line_among_logs(monkeypatch, tmp_path):
    python = fake_python(tmp_path, (
        "a = json.load(sys.stdin)\n"
        "assert sys.argv[1] == '-c' and 'LLM(' in sys.argv[2]\n"
        "print('INFO some vllm log line')\n"
        "for batch, prompts in reversed(a['batches']):  # mapped by its batch, not its place\n"
        f"    r = {CANNED!r}\n"
        "    r['seen'] = {'prompts': prompts, 'max_tokens': a['max_tokens'], 'k': a['k'],\n"
        "                 'draft': a['draft'], 'kv': os.environ['VLLM_CPU_KVCACHE_SPACE'],\n"
        "                 'preload': os.environ.get('LD_PRELOAD', '')}\n"
        "    print('FORERUN_RESULT ' + json.dumps({'batch': batch, **r}))\n"
        "print('INFO shutting down')"))
    (python.parent.parent / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv(tp.VLLM_VAR, str(python))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    peer, note = tp.VllmOffline.from_env(tmp_path / "target", tmp_path / "draft", k=3)
    assert peer is not None and note == "" and peer.label(4) == "vllm draft k=3"
    out = peer.run_batches({1: ["a"], 2: ["a", "b"]}, 8)
    assert list(out) == [1, 2]
    for batch, prompts in ((1, ["a"]), (2, ["a", "b"])):
        seen = out[batch].pop("seen")
        assert out[batch] == CANNED
        assert seen == {"prompts": prompts, "max_tokens": 8, "k": 3,
                        "draft": str(tmp_path / "draft"), "kv": str(tp.KV_CACHE_GB),
                        "preload": str(python.parent.parent / "lib" / "libiomp5.so")}


def test_a_failing_or_silent_peer_raises_with_its_output(tmp_path):
    python = fake_python(tmp_path, "print('boom', file=sys.stderr); sys.exit(3)")
    with pytest.raises(RuntimeError, match="exited 3 with no result line:\nboom"):
        tp.VllmOffline(python, tmp_path).run_batches({1: ["a"]}, 4)
    python.write_text(f"#!{sys.executable}\nprint('no result here')\n")
    with pytest.raises(RuntimeError, match="exited 0 with no result line:\nno result here"):
        tp.VllmOffline(python, tmp_path).run_batches({1: ["a"]}, 4)
    python.write_text(f"#!{sys.executable}\n"
                      "print('FORERUN_RESULT {\"batch\": 1, \"tok_s\": 1}')\n"
                      "raise SystemExit(1)\n")  # a shutdown that fails after the result
    assert tp.VllmOffline(python, tmp_path).run_batches({1: ["a"]}, 4) == {1: {"tok_s": 1}}


FIRST_BATCH_ONLY = "print('FORERUN_RESULT ' + json.dumps({'batch': 1, 'tok_s': 1}), flush=True)"


def test_batches_a_crash_or_a_timeout_never_reached_are_noted_beside_the_others(tmp_path):
    python = fake_python(tmp_path, FIRST_BATCH_ONLY + (
        "\nprint('Fatal: worker died', file=sys.stderr); sys.exit(1)"))
    out = tp.VllmOffline(python, tmp_path).run_batches({1: ["a"], 4: ["a"] * 4}, 4)
    assert out[1] == {"tok_s": 1}
    assert out[4]["error"].startswith(f"no result: {python} exited 1 before this batch:")
    assert "Fatal: worker died" in out[4]["error"]
    python.write_text(f"#!{sys.executable}\nimport json, time\n{FIRST_BATCH_ONLY}\n"
                      "time.sleep(60)\n")
    out = tp.VllmOffline(python, tmp_path, timeout=1).run_batches({1: ["a"], 2: ["a"] * 2}, 4)
    assert out[1] == {"tok_s": 1} and "timed out after 2 s before this batch" in out[2]["error"]


FAKE_VLLM = """
import json, os
from types import SimpleNamespace

def log(*event):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps([os.getpid(), *event]) + "\\n")

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0
        self.max_tokens = max_tokens

class Tokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<" + messages[0]["content"] + ">"

class LLM:
    def __init__(self, model, dtype, max_model_len, seed, speculative_config=None):
        log("load", model, speculative_config)

    def get_tokenizer(self):
        return Tokenizer()

    def reset_prefix_cache(self):
        log("reset")
        return True

    def generate(self, prompts, params, use_tqdm):
        log("generate", prompts, params.max_tokens)
        if len(prompts) == int(os.environ.get("FAKE_VLLM_FAIL_AT", "0")):
            raise ValueError("no room in the KV cache")
        return [SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=list(range(params.max_tokens)), text=p.upper())]) for p in prompts]
"""


def test_the_vllm_script_loads_once_warms_up_once_and_runs_every_batch(monkeypatch, tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_VLLM_FAIL_AT", "2")  # the batch of two raises in generate
    calls, real_run = [], subprocess.run

    def spy(*args, **kw):
        calls.append(kw["timeout"])
        return real_run(*args, **kw)

    monkeypatch.setattr(tp.subprocess, "run", spy)
    peer = tp.VllmOffline(Path(sys.executable), tmp_path / "target", tmp_path / "draft", k=3,
                          timeout=100)
    out = peer.run_batches({1: ["a"], 2: ["a", "b"], 3: ["a", "b", "c"]}, 5)
    assert calls == [300]  # one process for the three sizes, its timeout three sizes long
    assert out[2] == {"error": "ValueError: no room in the KV cache"}
    for batch in (1, 3):
        assert out[batch]["total_tokens"] == 5 * batch
        assert out[batch]["token_ids"] == [list(range(5))] * batch
        assert out[batch]["texts"] == ["<A>", "<B>", "<C>"][:batch]
        assert out[batch]["tok_s"] > 0 and out[batch]["per_seq_tok_s"] > 0
        assert out[batch]["load_s"] >= 0 and out[batch]["warmup_s"] >= 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert len({pid for pid, *_ in events}) == 1
    assert [e[1:] for e in events] == [
        ["load", str(tmp_path / "target"), {"model": str(tmp_path / "draft"),
                                            "num_speculative_tokens": 3}],
        ["generate", ["<a>"], tp.WARMUP_TOKENS],  # the untimed warm-up, once
        ["reset"], ["generate", ["<a>"], 5],
        ["reset"], ["generate", ["<a>", "<b>"], 5],
        ["reset"], ["generate", ["<a>", "<b>", "<c>"], 5]]


def test_per_batch_makes_a_peer_for_each_size_and_notes_a_failing_one():
    class Peer:
        def __init__(self, batch):
            self.batch = batch

        def label(self):
            return f"llama-server -np {self.batch}"

        def run(self, prompts, max_tokens):
            if self.batch == 2:
                raise RuntimeError("llama-server exited 1")
            return {"tokens": [max_tokens] * len(prompts), "np": self.batch}

    peer = tp.PerBatch(Peer)
    assert peer.label(4) == "llama-server -np 4"
    assert peer.run_batches({1: ["a"], 2: ["a", "b"], 4: ["a"] * 4}, 3) == {
        1: {"tokens": [3], "np": 1}, 2: {"error": "llama-server exited 1"},
        4: {"tokens": [3] * 4, "np": 4}}


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


def test_llama_server_peer_runs_without_repacked_weights_on_amx_cpus(monkeypatch, tmp_path):
    # upstream llama.cpp faults at start on AMX CPUs (forerun.runtime.llama_amx)
    for amx in (True, False):
        monkeypatch.setattr(tp, "cpu_has_amx", lambda amx=amx: amx)
        peer = tp.LlamaServerPeer(tmp_path / "llama-server", tmp_path / "t.gguf", parallel=2)
        assert ("--no-repack" in peer.command(1234)) == amx
        assert peer.label().endswith("--no-repack") == amx


def test_llama_server_peer_starts_sends_concurrently_and_stops(monkeypatch, tmp_path):
    pytest.importorskip("httpx")
    monkeypatch.setattr(tp, "cpu_has_amx", lambda: False)
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
