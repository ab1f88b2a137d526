"""Load a running `forerun serve` with concurrent streaming chat clients and report latency and
throughput, for speculation on / off / adaptive.

For each mode and each concurrency level C: C clients stream `--requests` requests each (prompts
in turn), and the script reports per-request TTFT (request sent -> first token) and tok/s, the
total tok/s of the level (all tokens / wall time), and p50/p90 inter-token latency (each chunk's
gap shared by the tokens it carries; the server's per-chunk stats say how many). The modes use
the request extension field `speculation`:

  on        {"method": M, "k": K}                     fixed k
  off       {"method": "none"} (same as "off")         plain decoding
  adaptive  {"method": M, "k": K, "policy": "cost"}   the cost model picks k per step (0 = off)
  server    {}: the server's defaults and flags (e.g. --spec-off-above)

A warm-up round per mode (C = the largest level, 2 tokens) is not timed: the cost policy measures
each slot's forward times at its first use. Prints a table and writes JSON (--json).

  python experiments/serve_load.py --base-url http://127.0.0.1:8000/v1 --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Refactor this function to use a dataclass:\n\ndef make_user(name, email, age):\n"
    "    return {\"name\": name, \"email\": email, \"age\": age}",
    "Explain what a Python context manager is, with a short example.",
    "Write a function that merges two sorted lists into one sorted list.",
]
WARMUP_TOKENS = 2


def speculation(mode: str, method: str, k: int) -> dict:
    """The request's extension field for a mode, asking for running stats in every chunk (they
    carry the token count, which spreads a chunk's gap over its tokens)."""
    fields = {"on": {"method": method, "k": k}, "off": {"method": "none"}, "server": {},
              "adaptive": {"method": method, "k": k, "policy": "cost"}}
    if mode not in fields:
        raise SystemExit(f"unknown mode {mode!r}; choose on, off, adaptive, server")
    return {"speculation": fields[mode] | {"stream_stats": True}}


@dataclass
class Result:
    ttft_s: float
    seconds: float
    tokens: int
    gaps: list[float] = field(default_factory=list)  # per-token inter-token latencies


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                      extra: dict) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}} | extra
    start = time.perf_counter()
    first = last = None
    tokens_seen, gaps, usage = 0, [], 0
    async with http.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"server answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"server error: {chunk['error']}")
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            if not chunk["choices"]:
                continue
            choice, now = chunk["choices"][0], time.perf_counter()
            tokens = (choice.get("speculation") or {}).get("new_tokens", tokens_seen)
            if tokens > tokens_seen:
                if first is None:
                    first = now
                else:
                    gaps += [(now - last) / (tokens - tokens_seen)] * (tokens - tokens_seen)
                last, tokens_seen = now, tokens
    end = time.perf_counter()
    return Result((first or end) - start, end - start, usage or tokens_seen, gaps)


async def level(base_url: str, headers: dict, model: str, prompts: list[str], clients: int,
                requests: int, max_tokens: int, extra: dict) -> tuple[list[Result], float]:
    async def client(i: int) -> list[Result]:
        return [await one_request(http, model, prompts[(i + j) % len(prompts)], max_tokens,
                                  extra) for j in range(requests)]

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None,
                                 limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(client(i) for i in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - start


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (0 for no values)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(mode: str, clients: int, results: list[Result], wall: float) -> dict:
    gaps = [g for r in results for g in r.gaps]
    tokens = sum(r.tokens for r in results)
    return {"mode": mode, "concurrency": clients, "requests": len(results), "tokens": tokens,
            "ttft_p50_s": statistics.median(r.ttft_s for r in results),
            "request_tok_s": statistics.median(r.tokens / r.seconds for r in results),
            "total_tok_s": tokens / wall, "itl_p50_ms": pct(gaps, 50) * 1000,
            "itl_p90_ms": pct(gaps, 90) * 1000, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the one the server lists")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    p.add_argument("--modes", default="on,off,adaptive", help="on, off, adaptive, server")
    p.add_argument("--method", default="draft", help="drafting method for on and adaptive")
    p.add_argument("-k", type=int, default=4, help="draft length for on (cap for adaptive)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable; default: four built-in code prompts)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/models", headers=headers).json()[
        "data"][0]["id"]
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = args.prompt or PROMPTS
    rows = []
    for mode in args.modes.split(","):
        extra = speculation(mode, args.method, args.k)
        asyncio.run(level(args.base_url, headers, model, prompts, max(levels), 1, WARMUP_TOKENS,
                          extra))
        for clients in levels:
            results, wall = asyncio.run(level(args.base_url, headers, model, prompts, clients,
                                              args.requests, args.max_tokens, extra))
            rows.append(summarize(mode, clients, results, wall))
            print(f"  {mode} x{clients}: {rows[-1]['total_tok_s']:.1f} tok/s", file=sys.stderr)
    print_table(rows)
    report = {"base_url": args.base_url, "model": model, "method": args.method, "k": args.k,
              "max_tokens": args.max_tokens, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0


def print_table(rows: list[dict]) -> None:
    cols = [("mode", "mode", "{}"), ("C", "concurrency", "{}"), ("reqs", "requests", "{}"),
            ("tokens", "tokens", "{}"), ("TTFT p50 s", "ttft_p50_s", "{:.3f}"),
            ("req tok/s", "request_tok_s", "{:.1f}"), ("total tok/s", "total_tok_s", "{:.1f}"),
            ("ITL p50 ms", "itl_p50_ms", "{:.1f}"), ("ITL p90 ms", "itl_p90_ms", "{:.1f}")]
    cells = [[fmt.format(row[key]) for _, key, fmt in cols] for row in rows]
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _, _) in
              enumerate(cols)]
    print("  ".join(name.rjust(w) for (name, _, _), w in zip(cols, widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
