"""Resident memory of `forerun serve` under C long requests, against weights + the KV in use.

Issue 41's memory target: at C=32 with 4k context, the server's resident memory stays within
its weights + 1.5x the KV cache its requests actually hold. This starts `forerun serve` (any
extra server arguments after `--`) on a free loopback port, waits until it is healthy, reads
its idle RSS, then sends C concurrent streaming chat requests at once, each a different long
stdlib document (the long_context workload's texts, cut to --prompt-tokens) with a short answer,
sampling the server's RSS every 0.5 s and its /metrics (KV bytes in use, prefix cache bytes)
every 2 s. Weights are the parameters' bytes as the runtime holds them: the GGUF's tensors'
element counts x 2 bytes under --dtype bfloat16 (torch runtime), or the GGUF files' sizes
(llama.cpp runtime, which maps them). Prints and writes (--out) one JSON record: idle and peak
RSS, weights, KV in use at the peak, the RSS over weights as a multiple of that KV, and whether
the target holds; stops the server by its PID.

    python experiments/serve_memory.py --clients 32 --prompt-tokens 3500 --out out/mem.json \
        -- --runtime torch --dtype bfloat16 --context 4096 --max-concurrent 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from gguf import GGUFReader

from forerun.bench.long_context import excerpt, rows
from forerun.bench.serve_peers import free_port
from forerun.bench.serving import rss_bytes
from forerun.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, lookup, model_path

CHARS_PER_TOKEN = 3.2  # Python source under Qwen's tokenizer, roughly: sizes the cuts


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def weights_bytes(paths: list[Path], bf16: bool) -> int:
    """What the runtime holds of these GGUF files: bf16 copies of every tensor (torch), or the
    files themselves (llama.cpp maps them)."""
    if not bf16:
        return sum(p.stat().st_size for p in paths)
    return sum(2 * int(t.n_elements) for p in paths for t in GGUFReader(p).tensors)


def prompts(n: int, tokens: int) -> list[list[dict]]:
    """n different long documents (cycling the workload's texts at shifted cuts)."""
    docs = [excerpt(r) for r in rows()]
    chars = int(tokens * CHARS_PER_TOKEN)
    out = []
    for i in range(n):
        doc = docs[i % len(docs)]
        start = (i // len(docs)) * 997 % max(1, len(doc) - chars)
        text = doc[start:start + chars]
        out.append([{"role": "user", "content": f"```python\n{text}```\n\nIn one sentence, what "
                     "does this code do?"}])
    return out


async def load(base: str, model: str, messages: list[list[dict]], max_tokens: int,
               pid: int) -> dict:
    rss: list[float] = []
    samples: list[tuple[float, float, float]] = []  # (RSS GB, KV GB in use, prefix GB)
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=None,
                                 limits=httpx.Limits(max_connections=len(messages) + 4)) as http:
        async def one(m: list[dict]) -> str:
            r = await http.post("/v1/chat/completions", json={
                "model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0})
            return "ok" if r.status_code == 200 else f"{r.status_code} {r.text[:200]}"

        async def sampler() -> None:
            tick = 0
            while not done.is_set():
                rss.append(rss_bytes(pid) / 1e9)
                if tick % 4 == 0:
                    text = (await http.get("/metrics")).text
                    samples.append((rss[-1], metric(text, "forerun_kv_cache_bytes_in_use") / 1e9,
                                    metric(text, "forerun_prefix_cache_bytes") / 1e9))
                tick += 1
                await asyncio.sleep(0.5)

        task = asyncio.create_task(sampler())
        t0 = time.monotonic()
        outcomes = await asyncio.gather(*(one(m) for m in messages))
        wall = time.monotonic() - t0
        done.set()
        await task
    return {"outcomes": outcomes, "rss": rss, "samples": samples, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=3500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", default="out/serve_memory.json")
    p.add_argument("server_args", nargs="*", help="after --: forerun serve's own arguments")
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "forerun.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), *args.server_args]
    server = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1800):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}")
            time.sleep(1)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        time.sleep(3)
        idle = rss_bytes(server.pid) / 1e9
        run = asyncio.run(load(base, model, prompts(args.clients, args.prompt_tokens),
                               args.max_tokens, server.pid))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    bf16 = "bfloat16" in args.server_args
    llama = "llama.cpp" in args.server_args
    files = [model_path(lookup(DEFAULT_TARGET)), model_path(lookup(DEFAULT_DRAFT))]
    weights = weights_bytes(files, bf16 and not llama) / 1e9
    peak_rss, kv_at_peak, prefix_at_peak = max(run["samples"]) if run["samples"] else (0, 0, 0)
    kv_peak = max((kv for _, kv, _ in run["samples"]), default=0.0)
    record = {
        "command": cmd[2:], "clients": args.clients, "prompt_tokens": args.prompt_tokens,
        "ok": run["outcomes"].count("ok"), "failed": [o for o in run["outcomes"] if o != "ok"][:3],
        "wall_s": round(run["wall_s"], 1), "rss_idle_gb": round(idle, 3),
        "rss_peak_gb": round(max(run["rss"], default=0.0), 3), "weights_gb": round(weights, 3),
        "kv_in_use_peak_gb": round(kv_peak, 3), "kv_in_use_at_rss_peak_gb": round(kv_at_peak, 3),
        "prefix_cache_at_rss_peak_gb": round(prefix_at_peak, 3),
        "rss_over_weights_per_kv": round((peak_rss - weights) / kv_at_peak, 2)
        if kv_at_peak else None,
        "target_met": bool(kv_at_peak) and peak_rss <= weights + 1.5 * kv_at_peak,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record | {"rss": run["rss"],
                                                   "samples": run["samples"]}, indent=1))
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
