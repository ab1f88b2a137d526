"""The serving benchmark: concurrent streaming chat clients against OpenAI-compatible servers.

Owns: driving C clients at once, each streaming `requests` chat requests in turn over a
prompt set (`level`); what one request measured (`Result`: TTFT from sending to the first
token, per-token gaps after it, tokens); a level's summary (total tok/s = all tokens / wall
time, per-request tok/s, TTFT and ITL p50/p99, the server's peak RSS while it ran, errors);
sampling a local server's RSS (`RssSampler`); the table and the plot (total tok/s and p50 ITL
against C, a line per configuration). Any server works (forerun, vLLM, llama-server): tokens
are counted from forerun's per-chunk stats where a chunk carries them, else one per chunk with
content, and the final usage corrects the total. Knows nothing of how the servers started.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WARMUP_TOKENS = 2
RSS_PERIOD_S = 0.2


@dataclass
class Result:
    ttft_s: float
    seconds: float
    tokens: int
    gaps: list[float] = field(default_factory=list)  # per-token inter-token latencies
    error: str | None = None
    text: str = ""
    turn: int = 0  # its place in its client's conversation (--multi-turn), else 0


async def one_request(http: httpx.AsyncClient, model: str, messages: list[dict],
                      max_tokens: int, extra: dict) -> Result:
    """One streamed request; a transport failure (the server hung up) is that request's error,
    counted in its level's `errors`, not the end of the benchmark. A keep-alive connection the
    server closed before answering ("disconnected without sending a response") is retried once
    on a new one, as HTTP clients do."""
    start = time.perf_counter()
    for attempt in (1, 2):
        try:
            return await _stream(http, model, messages, max_tokens, extra)
        except httpx.RemoteProtocolError as e:
            if attempt == 2 or "without sending a response" not in str(e):
                return Result(0.0, time.perf_counter() - start, 0, error=f"{e}"[:200])
        except (httpx.TransportError, json.JSONDecodeError) as e:
            return Result(0.0, time.perf_counter() - start, 0,
                          error=f"{type(e).__name__}: {e}"[:200])
    raise AssertionError("unreachable")


async def _stream(http: httpx.AsyncClient, model: str, messages: list[dict],
                  max_tokens: int, extra: dict) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}} | extra
    start = time.perf_counter()
    first = last = None
    seen, gaps, usage, parts = 0, [], 0, []
    async with http.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:200]
            return Result(0.0, time.perf_counter() - start, 0, error=f"{r.status_code} {text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Result(0.0, time.perf_counter() - start, seen, gaps,
                              error=str(chunk["error"])[:200])
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            if not chunk.get("choices"):
                continue
            choice, now = chunk["choices"][0], time.perf_counter()
            stats = choice.get("speculation") or {}
            content = (choice.get("delta") or {}).get("content")
            parts.append(content or "")
            tokens = stats.get("new_tokens", seen + (1 if content else 0))
            if tokens > seen:
                if first is None:
                    first = now
                else:
                    gaps += [(now - last) / (tokens - seen)] * (tokens - seen)
                last, seen = now, tokens
    end = time.perf_counter()
    return Result((first or end) - start, end - start, usage or seen, gaps, text="".join(parts))


async def _level(base_url: str, headers: dict, model: str, prompts: list[list[dict]],
                 clients: int, requests: int, max_tokens: int, extra: dict, multi_turn: bool
                 ) -> tuple[list[Result], float]:
    async def client(i: int) -> list[Result]:
        results, history = [], []
        for j in range(requests):
            turn = prompts[(i * requests + j) % len(prompts)]
            messages = history + turn if multi_turn else turn
            r = await one_request(http, model, messages, max_tokens, extra)
            results.append(r)
            if multi_turn:  # the next turn resends this whole conversation, as chat clients do
                r.turn, history = j, [*messages, {"role": "assistant", "content": r.text}]
        return results

    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None,
                                 limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(client(i) for i in range(clients)))
        return [r for rs in results for r in rs], time.perf_counter() - start


def level(base_url: str, headers: dict, model: str, prompts: list[list[dict]], clients: int,
          requests: int, max_tokens: int, extra: dict | None = None, multi_turn: bool = False
          ) -> tuple[list[Result], float]:
    """C = `clients` concurrent clients, each `requests` requests -> results, wall seconds.
    `multi_turn`: each client's requests are the turns of one conversation, every turn sent
    with the whole history before it (its earlier prompts and the replies it got)."""
    return asyncio.run(_level(base_url.rstrip("/"), headers, model, prompts, clients, requests,
                              max_tokens, extra or {}, multi_turn))


def served_model(base_url: str, headers: dict) -> str:
    """The first model the server lists."""
    r = httpx.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


class RssSampler:
    """The largest resident set of process `pid` (and its children's, as listed in /proc)
    seen since the last `take`, sampled every RSS_PERIOD_S on a thread. None: no process."""

    def __init__(self, pid: int | None):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if pid is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(RSS_PERIOD_S):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def take(self) -> float | None:
        """GB at the peak since the last take (then reset); None without a process."""
        if self.pid is None:
            return None
        peak, self.peak = max(self.peak, rss_bytes(self.pid)), 0
        return peak / 1e9

    def close(self) -> None:
        self._stop.set()


def rss_bytes(pid: int) -> int:
    """Resident bytes of a process and its direct children (0 once it is gone)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (0 for no values)."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(config: str, clients: int, results: list[Result], wall: float,
              rss_gb: float | None) -> dict:
    ok = [r for r in results if r.error is None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    later = [r.ttft_s for r in ok if r.turn > 0]
    return {"config": config, "concurrency": clients, "requests": len(results),
            "errors": len(results) - len(ok), "tokens": tokens, "wall_s": wall,
            "total_tok_s": tokens / wall if wall else 0.0,
            "request_tok_s": statistics.median(r.tokens / r.seconds for r in ok) if ok else 0.0,
            "ttft_p50_s": pct([r.ttft_s for r in ok], 50),
            "ttft_p99_s": pct([r.ttft_s for r in ok], 99),
            # later turns of a conversation (--multi-turn): a history the server saw before
            "ttft_later_turns_p50_s": pct(later, 50) if later else None,
            "itl_p50_ms": pct(gaps, 50) * 1000, "itl_p99_ms": pct(gaps, 99) * 1000,
            "peak_rss_gb": rss_gb,
            "first_error": next((r.error for r in results if r.error), None)}


COLUMNS = [("config", "config", "{}"), ("C", "concurrency", "{}"), ("reqs", "requests", "{}"),
           ("err", "errors", "{}"), ("total tok/s", "total_tok_s", "{:.1f}"),
           ("req tok/s", "request_tok_s", "{:.1f}"), ("TTFT p50 s", "ttft_p50_s", "{:.2f}"),
           ("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
           ("TTFT turn>1 s", "ttft_later_turns_p50_s", "{:.2f}"),
           ("ITL p50 ms", "itl_p50_ms", "{:.0f}"), ("ITL p99 ms", "itl_p99_ms", "{:.0f}"),
           ("RSS GB", "peak_rss_gb", "{:.1f}")]


def table(rows: list[dict]) -> str:
    cells = [[("-" if row[key] is None else fmt.format(row[key])) for _, key, fmt in COLUMNS]
             for row in rows]
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _, _) in
              enumerate(COLUMNS)]
    lines = ["  ".join(name.rjust(w) for (name, _, _), w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)) for c in cells]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Total tok/s and p50 ITL against C, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == config]
        cs = [r["concurrency"] for r in mine]
        left.plot(cs, [r["total_tok_s"] for r in mine], marker="o", label=config)
        right.plot(cs, [r["itl_p50_ms"] for r in mine], marker="o", label=config)
    for ax, label in ((left, "total tok/s"), (right, "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
