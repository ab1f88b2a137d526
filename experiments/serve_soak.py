"""Soak a running forerun server: C streaming clients for M minutes, some leaving mid-stream.

Every client loops over the workload prompts (chat, greedy); a `--disconnect` share of its
requests are dropped after 1-8 chunks on purpose. The server's RSS is sampled every second and
its /metrics (KV bytes in use, requests running, prefix-cache bytes) every 5 s. At the end, after
the server is idle: requests sent, completed, dropped on purpose and lost (an error, a truncated
stream, a hang), RSS when idle before and after, its peak, its slope over the second half
(MB/min), that slope less the prefix cache's blocks (bounded by their own budget), the KV bytes
still held. Writes soak.json and soak.png to --out and exits 1 if a request was lost or the KV
did not return to zero.

    forerun serve --port 8000 ... &
    python experiments/serve_soak.py --base-url http://127.0.0.1:8000 --pid $! --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from forerun.bench.serving import rss_bytes
from forerun.bench.workloads import BUILTIN, sample_workloads

REQUEST_TIMEOUT_S = 600  # a request that takes longer is a hang: lost


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


async def one(http: httpx.AsyncClient, model: str, messages: list, max_tokens: int,
              drop_after: int | None) -> str:
    """-> "done", "dropped" (left on purpose) or "lost: why"."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S), http.stream(
                "POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"lost: {r.status_code} {(await r.aread())[:200]!r}"
            chunks, finished = 0, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    return "done" if finished else "lost: [DONE] without a finish reason"
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"lost: {chunk['error']}"
                chunks += 1
                finished = finished or any(c.get("finish_reason") for c in chunk["choices"])
                if drop_after is not None and chunks >= drop_after:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return "lost: the stream ended without [DONE]"
    except (httpx.HTTPError, TimeoutError) as e:
        return f"lost: {type(e).__name__} {e}"


def mb_per_min(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, GB) points, in MB a minute (0: too few)."""
    if len(points) < 3:
        return 0.0
    return statistics.linear_regression([t for t, _ in points],
                                        [g for _, g in points]).slope * 60 * 1000


def prefix_at(kv: list[tuple[float, float, float, float]], t: float) -> float:
    """The prefix cache's GB at the last /metrics sample at or before `t` (0 before any)."""
    return next((p for s, _, _, p in reversed(kv) if s <= t), 0.0)


async def soak(args, prompts: list[list[dict]]) -> dict:
    base = args.base_url.rstrip("/")
    outcomes: list[str] = []
    samples: list[tuple[float, float]] = []  # (seconds, RSS GB)
    kv: list[tuple[float, float, float, float]] = []  # (s, KV GB in use, running, prefix GB)
    start = time.monotonic()
    end = start + args.minutes * 60
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients + 2)
    async with httpx.AsyncClient(base_url=f"{base}/v1", timeout=None, limits=limits) as http:
        model = (await http.get("/models")).json()["data"][0]["id"]

        async def client(i: int) -> None:
            n = 0
            while time.monotonic() < end:
                drop = rng.randint(1, 8) if rng.random() < args.disconnect else None
                outcomes.append(await one(http, model, prompts[(i * 7 + n) % len(prompts)],
                                          args.max_tokens, drop))
                n += 1

        async def sampler() -> None:
            tick = 0
            while time.monotonic() < end:
                t = time.monotonic() - start
                samples.append((t, rss_bytes(args.pid) / 1e9))
                if tick % 5 == 0:
                    text = (await http.get(f"{base}/metrics")).text
                    kv.append((t, metric(text, "forerun_kv_cache_bytes_in_use") / 1e9,
                               metric(text, "forerun_requests_running"),
                               metric(text, "forerun_prefix_cache_bytes") / 1e9))
                tick += 1
                await asyncio.sleep(1)

        idle_before = rss_bytes(args.pid) / 1e9
        await asyncio.gather(sampler(), *(client(i) for i in range(args.clients)))
        for _ in range(120):  # until the server has let every request go
            health = (await http.get(f"{base}/health")).json()
            if health["running"] == health["waiting"] == 0:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)
        text = (await http.get(f"{base}/metrics")).text
    half = [(t, g) for t, g in samples if t >= args.minutes * 30]
    slope = mb_per_min(half)
    # RSS less the prefix cache's blocks (bounded by its own budget): what else grows
    net = [(t, g - prefix_at(kv, t)) for t, g in half]
    lost = [o for o in outcomes if o.startswith("lost")]
    return {"clients": args.clients, "minutes": args.minutes, "requests": len(outcomes),
            "done": outcomes.count("done"), "dropped": outcomes.count("dropped"),
            "lost": len(lost), "first_lost": lost[:3], "rss_idle_before_gb": idle_before,
            "rss_idle_after_gb": rss_bytes(args.pid) / 1e9,
            "rss_peak_gb": max((g for _, g in samples), default=0.0),
            "rss_slope_second_half_mb_per_min": slope,
            "rss_less_prefix_cache_slope_second_half_mb_per_min": mb_per_min(net),
            "prefix_cache_after_gb": metric(text, "forerun_prefix_cache_bytes") / 1e9,
            "kv_in_use_after_gb": metric(text, "forerun_kv_cache_bytes_in_use") / 1e9,
            "kv_peak_gb": max((g for _, g, _, _ in kv), default=0.0),
            "rss": samples, "kv": kv}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([t / 60 for t, _ in report["rss"]], [g for _, g in report["rss"]], label="RSS")
    ax.plot([t / 60 for t, _, _, _ in report["kv"]], [g for _, g, _, _ in report["kv"]],
            label="KV in use")
    ax.plot([t / 60 for t, _, _, _ in report["kv"]], [p for _, _, _, p in report["kv"]],
            label="prefix cache")
    ax.set_xlabel("minutes")
    ax.set_ylabel("GB")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"soak: {report['clients']} clients, {report['requests']} requests, "
                 f"{report['dropped']} dropped on purpose, {report['lost']} lost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--pid", type=int, required=True, help="the server's PID (its RSS)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--disconnect", type=float, default=0.25,
                   help="share of requests dropped mid-stream on purpose")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/soak")
    args = p.parse_args()
    prompts = [list(x.messages) for x in sample_workloads(list(BUILTIN), 5, args.seed)]
    report = asyncio.run(soak(args, prompts))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k not in ("rss", "kv")}, indent=1))
    return 1 if report["lost"] or report["kv_in_use_after_gb"] > 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
