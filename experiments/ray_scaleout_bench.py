"""Scale-out on Ray against one bigger replica: N replicas of c cores each vs 1 replica of N x c.

Starts `forerun serve` for each configuration on a free loopback port, one at a time, each
stopped by its PID before the next starts (a --ray one stops its own local Ray cluster):
- `ray-2x1`: `--ray --replicas 2 --replica-cores 1` (each replica pinned to its own core);
- `ray-1x2`: `--ray --replicas 1 --replica-cores 2` (the same total cores, one replica);
- `plain-2`: `forerun serve` without Ray on the same cores (what Ray's hops cost).
Each is measured at every C of --concurrency with streaming chat clients over the built-in
workloads (`forerun.bench.serving`): total tok/s, request latency p50/p99, TTFT and ITL, and
the cores each kind of process used meanwhile (the replicas' engines; Ray's proxy, ingress,
controller, GCS and raylet; read from /proc over the server's process tree). Prints a table
and the ratio of each configuration's total tok/s to ray-1x2's at every C; writes
ray_scaleout.json to --out.

    flock /tmp/forerun-bench.lock python experiments/ray_scaleout_bench.py \\
        --runtime llama.cpp --max-tokens 32 --out runs/ray-scaleout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from forerun.bench import serving
from forerun.bench.serve_peers import PeerServer, free_port, start, stop
from forerun.bench.workloads import BUILTIN, sample_workloads
from forerun.models.catalog import DEFAULT_TARGET

CONFIGS = {"ray-2x1": ["--ray", "--replicas", "2", "--replica-cores", "1"],
           "ray-1x2": ["--ray", "--replicas", "1", "--replica-cores", "2"],
           "plain-2": []}
BASELINE = "ray-1x2"
READY_S = 600  # every replica running within this long


# process kinds by a piece of their title (Ray names its workers ray::...)
KINDS = (("EngineReplica", "replica"), ("forerun.cli", "server"), ("Ingress", "ingress"),
         ("ProxyActor", "proxy"), ("ServeController", "controller"), ("gcs_server", "gcs"),
         ("raylet", "raylet"))


def cpu_seconds(root: int) -> Counter:
    """CPU seconds so far of `root` and every process below it, by kind (KINDS, else "ray")."""
    out: Counter = Counter()
    stack, tick = [root], os.sysconf("SC_CLK_TCK")
    while stack:
        pid = stack.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stack += [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                      for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        kind = next((k for piece, k in KINDS if piece in title), "ray")
        out[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def server(name: str, args, port: int) -> PeerServer:
    top = max(int(c) for c in args.concurrency.split(","))
    return PeerServer(name, (
        sys.executable, "-m", "forerun.cli", "serve", "--target", args.target, "--runtime",
        args.runtime, "--method", args.method, "--spec-policy", args.spec_policy,
        "--port", str(port), "--max-concurrent", str(top), "--max-queue", str(top),
        "--max-tokens-limit", str(args.max_tokens), "--kv-cache-gb", str(args.kv_cache_gb),
        "--log-level", "warning",
        *CONFIGS[name]))


def all_replicas_running(base: str, name: str) -> None:
    """A --ray server answers /health once one replica runs; wait for all of them."""
    want = int(CONFIGS[name][2]) if CONFIGS[name] else 0
    deadline = time.monotonic() + READY_S
    while want and time.monotonic() < deadline:
        running = httpx.get(f"{base}/health", timeout=10).json()["replicas"].get("RUNNING", 0)
        if running >= want:
            return
        time.sleep(1)
    if want:
        raise RuntimeError(f"{name}: not every replica running after {READY_S} s")


def measure(name: str, url: str, pid: int, args, prompts, levels: list[int]) -> list[dict]:
    model = serving.served_model(url, {})
    serving.level(url, {}, model, prompts, max(levels), 1, serving.WARMUP_TOKENS)
    rows = []
    for c in levels:
        before = cpu_seconds(pid)
        results, wall = serving.level(url, {}, model, prompts, c, args.requests_per_client,
                                      args.max_tokens)
        used = cpu_seconds(pid)
        used.subtract(before)
        row = serving.summarize(name, c, results, wall, None)
        row["cores"] = {k: round(v / wall, 3) for k, v in sorted(used.items())}
        latencies = [r.seconds for r in results if r.error is None]
        row |= {"latency_p50_s": serving.pct(latencies, 50),
                "latency_p99_s": serving.pct(latencies, 99)}
        rows.append(row)
        print(f"  {name} x{c}: {row['total_tok_s']:.1f} tok/s, latency p50 "
              f"{row['latency_p50_s']:.2f} s p99 {row['latency_p99_s']:.2f} s, "
              f"{row['errors']} errors; cores {row['cores']}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["concurrency"]: r["total_tok_s"] for r in rows if r["config"] == BASELINE}
    lines = [f"{'config':>8} {'C':>3} {'tok/s':>7} {'vs 1x2':>7} {'lat p50 s':>9} "
             f"{'lat p99 s':>9} {'TTFT p50':>8} {'ITL p50 ms':>10} {'err':>3} "
             f"{'engine cores':>12} {'other cores':>11}"]
    for r in rows:
        ratio = r["total_tok_s"] / base[r["concurrency"]] if base.get(r["concurrency"]) else 0
        # the engine: the replicas, or the plain server's own process
        engine = r["cores"].get("replica", 0) or r["cores"].get("server", 0)
        other = sum(r["cores"].values()) - engine
        lines.append(f"{r['config']:>8} {r['concurrency']:>3} {r['total_tok_s']:>7.1f} "
                     f"{ratio:>7.2f} {r['latency_p50_s']:>9.2f} {r['latency_p99_s']:>9.2f} "
                     f"{r['ttft_p50_s']:>8.2f} {r['itl_p50_ms']:>10.0f} {r['errors']:>3} "
                     f"{engine:>12.2f} {other:>11.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--runtime", default="llama.cpp")
    p.add_argument("--method", default="ngram",
                   help="the servers' drafting method (ngram: no draft model to load twice)")
    p.add_argument("--spec-policy", default="adaptive")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--concurrency", default="1,2,4,8,16,32")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="per replica")
    p.add_argument("--out", default="runs/ray-scaleout")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [list(w.messages) for w in sample_workloads(list(BUILTIN), None, args.seed)]
    rows: list[dict] = []
    for name in args.configs.split(","):
        port = free_port()
        started = time.perf_counter()
        proc, url = start(server(name, args, port), port, out / f"serve-{name}.log")
        try:
            all_replicas_running(url.removesuffix("/v1"), name)
            print(f"{name}: up in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            rows += measure(name, url, proc.pid, args, prompts, levels)
        finally:
            stop(proc)
        (out / "ray_scaleout.json").write_text(json.dumps(
            {"args": vars(args), "rows": rows}, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
