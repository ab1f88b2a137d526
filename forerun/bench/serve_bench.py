"""`forerun bench serve`: starting and stopping the servers it measures, and its outputs.

Owns: its flags, starting a `forerun serve` per --spec-policies on a free loopback port (the
bench's model flags, the first of --methods and --ks) and each peer of --serve-peers
(`forerun.bench.serve_peers`), one at a time, each stopped by its PID before the next starts,
and taking any other OpenAI-compatible server by --base-url; then every configuration at every
C of --concurrency (`forerun.bench.serving`), and the outputs: a table on stdout,
serve_bench.json and serve_bench.png in --out, one JSON summary as the last stdout line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console

from forerun.bench import serving
from forerun.bench.serve_peers import (
    DEFAULT_PEER_CACHE,
    SERVE_PEERS,
    PeerServer,
    free_port,
    peer_servers,
    start,
    stop,
)
from forerun.bench.workloads import BUILTIN, sample_workloads
from forerun.models.load import open_model

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"


def add_serve_args(b) -> None:
    g = b.add_argument_group("serve (forerun bench serve)")
    g.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help="comma-separated numbers of concurrent streaming clients")
    g.add_argument("--requests-per-client", type=int, default=2,
                   help="chat requests each client sends in turn, per level")
    g.add_argument("--multi-turn", action="store_true",
                   help="each client's requests are the turns of one chat, each sent with the "
                        "whole history before it (prefix caching's case: TTFT turn>1)")
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
    g.add_argument("--serve-peers", default="", metavar="NAMES",
                   help=f"comma-separated peer servers to start and measure too: "
                        f"{', '.join(SERVE_PEERS)} (-draft: with the draft model, k = the first "
                        "of --ks); installed apart from forerun, found through "
                        "FORERUN_VLLM_PYTHON and FORERUN_LLAMA_SERVER "
                        "(docs/results/peers-setup.md); one not installed is skipped")
    g.add_argument("--peer-cache", default=DEFAULT_PEER_CACHE, metavar="DIR",
                   help="where the bf16 Hugging Face folders vLLM needs are made from the GGUFs "
                        "(once; minutes) unless --vllm-model / --vllm-draft name them")


def _model_flags(args) -> list[str]:
    flags = ["--target", args.target, "--dtype", args.dtype, "--draft-dtype", args.draft_dtype,
             "--draft-vocab", str(args.draft_vocab), "--device", args.device,
             "--context", str(args.context), "--runtime", args.runtime]
    if args.draft:
        flags += ["--draft", args.draft]
    if args.heads:
        flags += ["--heads", args.heads]
    return flags


def forerun_server(args, policy: str, clients: int, port: int) -> PeerServer:
    """`forerun serve` for `policy` on `port`, the bench's model flags, the first of --methods
    and --ks, room for `clients` in flight and their queued requests."""
    method, k = args.methods.split(",")[0], args.ks.split(",")[0]
    return PeerServer(f"forerun {policy}", (
        sys.executable, "-m", "forerun.cli", "serve", *_model_flags(args), "--method", method,
        "-k", k, "--spec-policy", policy, "--port", str(port), "--max-concurrent", str(clients),
        "--max-queue", str(clients * args.requests_per_client), "--max-tokens-limit",
        str(max(args.max_tokens, 1)), "--log-level", "warning", *args.server_arg))


def _peers(args, slots: int) -> tuple[list, list[str]]:
    """--serve-peers -> ([(key, port -> PeerServer)], notes on those skipped)."""
    names = [n.strip() for n in args.serve_peers.split(",") if n.strip()]
    if not names:
        return [], []
    target = open_model(args.target).path
    if target.suffix != ".gguf":
        return [], [f"--serve-peers skipped: the peers start from a GGUF target, not {target}"]
    draft = open_model(args.draft).path if args.draft else None
    return peer_servers(
        names, target_gguf=target, draft_gguf=draft if draft and draft.suffix == ".gguf" else None,
        k=int(args.ks.split(",")[0]), slots=slots, context=args.context,
        cache=Path(args.peer_cache).expanduser(),
        vllm_model=Path(args.vllm_model) if args.vllm_model else None,
        vllm_draft=Path(args.vllm_draft) if args.vllm_draft else None)


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
    if not policies and not urls and not args.serve_peers:
        raise ValueError("nothing to measure: give --spec-policies, --serve-peers or --base-url")
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
                                                  args.requests_per_client, args.max_tokens,
                                                  multi_turn=args.multi_turn)
                rows.append(serving.summarize(name, c, results, wall, sampler.take()))
                (out / "serve_bench.partial.json").write_text(json.dumps(rows, indent=2))
                err.print(f"  {name} x{c}: {rows[-1]['total_tok_s']:.1f} tok/s total, "
                          f"{rows[-1]['errors']} errors", highlight=False)
        finally:
            sampler.close()

    servers = [(f"forerun-{p}", lambda port, p=p: forerun_server(args, p, max(levels), port))
               for p in policies]
    peers, notes = _peers(args, max(levels))
    for note in notes:
        err.print(note, highlight=False)
    for key, make in servers + peers:
        port = free_port()
        server = make(port)
        with err.status(f"starting {server.name} (minutes for a peer's first start)"):
            proc, url = start(server, port, out / f"serve-{key}.log")
        try:
            measure(server.name, url, proc.pid, {})
        finally:
            stop(proc)
    for name, url in urls:
        measure(name, url, pids.get(name), headers)
    print(serving.table(rows))
    report = meta | {"max_tokens": args.max_tokens, "prompts": len(prompts),
                     "requests_per_client": args.requests_per_client,
                     "multi_turn": args.multi_turn,
                     "method": args.methods.split(",")[0], "k": int(args.ks.split(",")[0]),
                     "skipped": notes, "rows": rows}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    serving.plot(rows, out / "serve_bench.png",
                 f"{Path(args.target).name}: {args.max_tokens} tokens per request")
    err.print(f"wrote {out / 'serve_bench.json'} and {out / 'serve_bench.png'}")
    print(json.dumps({"rows": rows}))
    return 0
