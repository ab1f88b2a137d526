"""`forerun bench serve`: starting and stopping the servers it measures, and its outputs.

Owns: its flags, starting a `forerun serve` per --spec-policies on a free loopback port (the
bench's model flags, the first of --methods and --ks), waiting for it, stopping it by its PID,
and taking any other OpenAI-compatible server by --base-url; then every configuration at every
C of --concurrency (`forerun.bench.serving`), and the outputs: a table on stdout,
serve_bench.json and serve_bench.png in --out, one JSON summary as the last stdout line.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from forerun.bench import serving
from forerun.bench.workloads import BUILTIN, sample_workloads

START_TIMEOUT_S = 1800  # loading and calibrating bf16 weights on 2 cores takes minutes
DEFAULT_CONCURRENCY = "1,2,4,8,16,32"


def add_serve_args(b) -> None:
    g = b.add_argument_group("serve (forerun bench serve)")
    g.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help="comma-separated numbers of concurrent streaming clients")
    g.add_argument("--requests-per-client", type=int, default=2,
                   help="chat requests each client sends in turn, per level")
    g.add_argument("--spec-policies", default="adaptive,off",
                   help="start forerun serve once per policy (adaptive, always, off), with "
                        "the first of --methods and --ks; empty = start none")
    g.add_argument("--base-url", action="append", default=[], metavar="[NAME=]URL",
                   help="also measure this running OpenAI-compatible server (vLLM, "
                        "llama-server, another forerun), e.g. vllm=http://127.0.0.1:8001/v1 "
                        "(repeatable)")
    g.add_argument("--server-pid", action="append", default=[], metavar="NAME=PID",
                   help="sample this process's RSS for the --base-url server NAME")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for the forerun servers it starts (repeatable), "
                        "e.g. --server-arg=--kv-cache-gb=4")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token to --base-url")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model_flags(args) -> list[str]:
    flags = ["--target", args.target, "--dtype", args.dtype, "--draft-dtype", args.draft_dtype,
             "--draft-vocab", str(args.draft_vocab), "--device", args.device,
             "--context", str(args.context), "--runtime", args.runtime]
    if args.draft:
        flags += ["--draft", args.draft]
    if args.heads:
        flags += ["--heads", args.heads]
    return flags


def start_forerun(args, policy: str, clients: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A forerun server for `policy`, healthy -> (its process, its /v1 URL)."""
    port = free_port()
    method, k = args.methods.split(",")[0], args.ks.split(",")[0]
    cmd = [sys.executable, "-m", "forerun.cli", "serve", *_model_flags(args), "--method",
           method, "-k", k, "--spec-policy", policy, "--port", str(port), "--max-concurrent",
           str(clients), "--max-queue", str(clients * args.requests_per_client),
           "--max-tokens-limit", str(max(args.max_tokens, 1)), "--log-level", "warning",
           *args.server_arg]
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"forerun serve ({policy}) exited {proc.returncode} before it "
                               f"was healthy; its log: {log}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, f"{base}/v1"
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"forerun serve ({policy}) not healthy after {START_TIMEOUT_S} s: {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _named(values: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for i, v in enumerate(values):
        name, sep, rest = v.partition("=")
        if sep and "://" not in name:
            out.append((name, rest))
        elif what == "pid":
            raise ValueError(f"--server-pid: expected NAME=PID, got {v!r}")
        else:
            out.append((f"server{i + 1}", v))
    return out


def run(args, out: Path, meta: dict) -> int:
    err = Console(stderr=True)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1 or args.requests_per_client < 1:
        raise ValueError("--concurrency needs client counts >= 1 and --requests-per-client >= 1")
    policies = [p for p in args.spec_policies.split(",") if p.strip()]
    urls = _named(args.base_url, "url")
    pids = {n: int(p) for n, p in _named(args.server_pid, "pid")}
    if not policies and not urls:
        raise ValueError("nothing to measure: give --spec-policies or --base-url")
    prompts = [list(p.messages) for p in sample_workloads(args.workload or list(BUILTIN),
                                                          args.limit or None, args.seed)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: list[dict] = []

    def measure(name: str, url: str, pid: int | None, head: dict) -> None:
        model = serving.served_model(url, head)
        sampler = serving.RssSampler(pid)
        try:
            serving.level(url, head, model, prompts, max(levels), 1, serving.WARMUP_TOKENS)
            for c in levels:
                with err.status(f"{name}: {c} clients"):
                    results, wall = serving.level(url, head, model, prompts, c,
                                                  args.requests_per_client, args.max_tokens)
                rows.append(serving.summarize(name, c, results, wall, sampler.take()))
                err.print(f"  {name} x{c}: {rows[-1]['total_tok_s']:.1f} tok/s total, "
                          f"{rows[-1]['errors']} errors", highlight=False)
        finally:
            sampler.close()

    for policy in policies:
        with err.status(f"starting forerun serve --spec-policy {policy}"):
            proc, url = start_forerun(args, policy, max(levels), out / f"serve-{policy}.log")
        try:
            measure(f"forerun {policy}", url, proc.pid, {})
        finally:
            stop(proc)
    for name, url in urls:
        measure(name, url, pids.get(name), headers)
    print(serving.table(rows))
    report = meta | {"max_tokens": args.max_tokens, "prompts": len(prompts),
                     "requests_per_client": args.requests_per_client,
                     "method": args.methods.split(",")[0], "k": int(args.ks.split(",")[0]),
                     "rows": rows}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    serving.plot(rows, out / "serve_bench.png",
                 f"{Path(args.target).name}: {args.max_tokens} tokens per request")
    err.print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    print(json.dumps({"rows": rows}))
    return 0
