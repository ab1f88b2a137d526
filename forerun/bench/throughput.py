"""`forerun bench throughput`: offline batches, the job users run against vLLM's `LLM.generate`.

Owns: running one fixed prompt set at each batch size under each speculation mode, in one
process on one loaded engine, and the figures of each cell:
- total tok/s = every new token of the batch / the batch's wall time (admission to the last
  token, prefills included);
- per-sequence tok/s = the median over the batch's sequences of its new tokens / its own wall
  time (what one user of a server that batched them would see);
- peak KV = the most cache bytes the batch had reserved at once (the pool's high-water mark),
  and the process's peak resident memory so far;
- chosen k = mean draft tokens per verify step over the batch's sequences (the cost policy
  shrinks it as the batch fills);
- speedup = total tok/s / the plain batch's total tok/s at the same batch size, same run;
- identical = share of greedy sequences whose tokens equal the same prompt's plain batch output.
Modes: off (plain batched decoding), fixed (every member drafts k), cost (`--policy cost`:
every member's k chosen together from the measured cost of a pass of n rows). Peers (vLLM,
llama.cpp's llama-server) run the same prompts beside, where installed (`throughput_peers`).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from forerun.api import Engine
from forerun.propose import SpecConfig
from forerun.sampling import SamplingConfig

BATCH_SIZES = (1, 4, 8, 16, 32)
MODES = ("off", "fixed", "cost")


@dataclass(frozen=True)
class ThroughputCell:
    system: str  # "forerun" or a peer's name
    mode: str  # off / fixed / cost (forerun), or the peer's own label
    batch: int
    total_tok_s: float
    per_seq_tok_s: float
    wall_s: float
    new_tokens: int
    chosen_k: float  # mean draft tokens per verify step (0 for plain)
    peak_kv_bytes: int
    peak_rss_bytes: int
    speedup: float = 0.0  # vs forerun's plain batch at this size
    identical: float | None = None  # share of sequences equal to plain batching's (greedy)
    solo: float | None = None  # share equal to solo plain decoding's (one prompt alone)


def spec_of(mode: str, method: str, k: int) -> SpecConfig:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if mode == "off":
        return SpecConfig("none")
    return SpecConfig(method, k, "cost" if mode == "cost" else "fixed")


def run_cell(engine: Engine, prompts: list, mode: str, method: str, k: int, batch: int,
             max_tokens: int, kv_budget_bytes: int) -> tuple[ThroughputCell, list[list[int]]]:
    """One batch of `batch` prompts (the first ones of `prompts`, cycled) under `mode`."""
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    spec = spec_of(mode, method, k)
    engine.kv_peak_bytes(reset=True)
    start = time.perf_counter()
    outs = engine.generate_batch(chosen, sampling=SamplingConfig(), max_tokens=max_tokens,
                                 spec=spec, max_batch=batch, kv_budget_bytes=kv_budget_bytes)
    wall = time.perf_counter() - start
    tokens = sum(o.stats.new_tokens for o in outs)
    verify = sum(max(o.stats.target_forward_passes - 1, 0) for o in outs)
    drafted = sum(o.stats.drafted for o in outs)
    cell = ThroughputCell(
        "forerun", mode, batch, tokens / wall,
        statistics.median(o.stats.tokens_per_s for o in outs), wall, tokens,
        drafted / verify if verify else 0.0,
        engine.kv_peak_bytes(),
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return cell, [o.token_ids for o in outs]


def run_throughput(engine: Engine, prompts: list, modes: tuple[str, ...], method: str, k: int,
                   batches: tuple[int, ...], max_tokens: int, kv_budget_bytes: int,
                   on_cell=None) -> list[ThroughputCell]:
    """Every mode at every batch size; plain ("off") first at each size, as the baseline.
    The cost policy's pass-cost curves are measured first, untimed (a one-token batch)."""
    if "cost" in modes:
        run_cell(engine, prompts, "cost", method, k, 1, 1, kv_budget_bytes)
    # the oracle: each prompt decoded alone, plain (untimed); batch invariance is measured on it
    used = min(len(prompts), max(batches))
    solo = [engine.generate(engine.tokenizer.encode_chat(p) if p and isinstance(p[0], dict)
                            else p, sampling=SamplingConfig(), max_tokens=max_tokens,
                            spec=SpecConfig("none")).token_ids for p in prompts[:used]]
    cells = []
    for batch in batches:
        plain, plain_ids = None, None
        for mode in ("off", *(m for m in modes if m != "off")):
            cell, ids = run_cell(engine, prompts, mode, method, k, batch, max_tokens,
                                 kv_budget_bytes)
            if mode == "off":
                plain, plain_ids = cell, ids
            same = sum(a == b for a, b in zip(ids, plain_ids, strict=True)) / len(ids)
            alone = sum(a == solo[i % used] for i, a in enumerate(ids)) / len(ids)
            cell = ThroughputCell(**{**asdict(cell), "speedup": cell.total_tok_s /
                                     max(plain.total_tok_s, 1e-9), "identical": same,
                                     "solo": alone})
            if mode in modes:
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
    return cells


def rows(cells: list[ThroughputCell]) -> list[tuple[str, ...]]:
    """Table rows: system, mode, batch, total tok/s, per-seq tok/s, speedup, chosen k, peak KV
    MiB, the shares of outputs equal to plain batching's and to solo plain decoding's."""
    return [(c.system, c.mode, str(c.batch), f"{c.total_tok_s:.1f}", f"{c.per_seq_tok_s:.2f}",
             f"{c.speedup:.2f}x" if c.speedup else "-", f"{c.chosen_k:.2f}",
             f"{c.peak_kv_bytes / 2**20:.0f}",
             "-" if c.identical is None else f"{c.identical:.2f}",
             "-" if c.solo is None else f"{c.solo:.2f}") for c in cells]


COLUMNS = ("system", "mode", "batch", "total tok/s", "per-seq tok/s", "vs plain", "chosen k",
           "peak KV MiB", "= plain batch", "= solo plain")


def markdown(cells: list[ThroughputCell], title: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(cells)]
    return "\n".join(lines) + "\n"


def plot(path, cells: list[ThroughputCell], title: str) -> None:
    """Total tok/s against batch size, one line per system and mode."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label in dict.fromkeys(f"{c.system} {c.mode}" for c in cells):
        cs = sorted((c for c in cells if f"{c.system} {c.mode}" == label), key=lambda c: c.batch)
        ax.plot([c.batch for c in cs], [c.total_tok_s for c in cs], marker="o", label=label,
                ls="--" if not label.startswith("forerun") else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the batch")
    ax.set_ylabel("total tokens/s")
    ax.set_title(textwrap.fill(title, 90), fontsize=9)  # a long title stays inside the figure
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peer_cells(peers: list, prompts: list[str], batches: tuple[int, ...], max_tokens: int,
               plain: dict[int, float], on_cell=None) -> list[ThroughputCell]:
    """Each peer (`throughput_peers.BatchPeer`) on the same prompts at every batch size, in one
    `run_batches` call (vLLM loads once for all of them); `plain` = forerun's plain total tok/s
    per batch size. Cells come batch by batch, each peer in turn. A peer, or one of its batch
    sizes, that fails is reported on stderr and skipped, not fatal."""
    chosen = {batch: [prompts[i % len(prompts)] for i in range(batch)] for batch in batches}
    results = []
    for peer in peers:
        try:
            results.append(peer.run_batches(chosen, max_tokens))
        except (RuntimeError, OSError) as e:
            print(f"peer {peer.label(batches[0])} failed: {str(e)[:300]}", file=sys.stderr)
            results.append({})
    cells = []
    for batch in batches:
        for peer, by_batch in zip(peers, results, strict=True):
            r = by_batch.get(batch)
            if r is not None and "error" in r:
                print(f"peer {peer.label(batch)} at batch {batch} failed: {r['error'][:300]}",
                      file=sys.stderr)
            elif r is not None:
                cells.append(peer_cell(peer.label(batch), batch, r, plain.get(batch, 0.0)))
                if on_cell is not None:
                    on_cell(cells[-1])
    return cells


def peer_cell(label: str, batch: int, r: dict, plain_tok_s: float) -> ThroughputCell:
    """A peer's figures at one batch size as a cell: its label's first word is the system, the
    rest the mode; chosen k = drafted tokens per completion token, where it reports drafts."""
    system, *mode = label.split(" ")
    drafted = r.get("draft_n", 0)
    return ThroughputCell(
        system, " ".join(mode) or "plain", batch, r["tok_s"], r["per_seq_tok_s"], r["wall_s"],
        r["total_tokens"], drafted / max(r["total_tokens"], 1) if drafted else 0.0, 0, 0,
        r["tok_s"] / max(plain_tok_s, 1e-9) if plain_tok_s else 0.0)
