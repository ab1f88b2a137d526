"""Benchmark report: per-category aggregates, a readable table, a JSON file and a PNG plot.

Owns: how runs become figures. For each (temperature, category, label):
- tok/s = total new tokens / total wall time over the category's prompts (prefill included);
- speedup = that tok/s / the forerun plain baseline's tok/s on the same prompts, same run;
  `vs own plain` divides by the same system's plain decoding instead (peers);
- decode (speedup) = the same ratio after the first token: (new tokens - 1) / (wall - TTFT),
  summed over the prompts. Prefill is the same work with or without a drafter, so where it is
  most of the wall (long prompts on a CPU) the speedup is diluted; this is the drafter's own;
- mean accepted length = mean over verify steps of (accepted + 1), incl. the bonus token;
- acceptance rate = accepted / drafted draft tokens;
- TTFT = median time to the first token; ITL p50 / p90 = quantiles over decode steps of
  (gap between steps / tokens in the step): what a streaming client sees per token;
- identical = share of greedy runs whose token ids equal their baseline's, in every repeat
  (a prompt counts as identical only if all its repeats were); `divergences` lists the others:
  where each (its first differing repeat) parted from plain and plain's logit margin there.
A category named "mean" is added: the unweighted mean of the per-category speedups (Spec-Bench's
headline figure) and medians of the rest, over every category but EditEval's, which stands as
its own figure (a mean over both workloads would be neither's).
- prefill ceiling = the plain baseline's total wall / its total TTFT, per category (and their
  mean, as above): the end-to-end speedup a drafter infinitely fast after the first token would
  reach, since the prefill is the same work with or without one. On a 2-core CPU, Spec-Bench's
  rag prompts (~800 tokens, ~18-token replies) spend ~90% of their wall in the prefill: 1.11x.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from forerun.bench.runner import BASELINE, Run

MEAN = "mean"
OWN_FIGURE = frozenset({"editeval"})  # categories left out of the mean


@dataclass(frozen=True)
class Cell:
    temperature: float
    category: str
    label: str
    prompts: int
    new_tokens: int
    tokens_per_s: float
    speedup: float
    vs_own_plain: float
    decode_speedup: float
    mean_accepted_length: float | None
    acceptance_rate: float | None
    ttft_s: float
    itl_p50_s: float
    itl_p90_s: float
    identical: float | None


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _tps(runs: list[Run]) -> float:
    wall = sum(r.wall_s for r in runs)
    return sum(r.new_tokens for r in runs) / wall if wall > 0 else 0.0


def _decode_tps(runs: list[Run]) -> float:
    """tok/s after the first token: what the drafter speeds up (prefill excluded)."""
    wall = sum(max(0.0, r.wall_s - r.ttft_s) for r in runs)
    return sum(max(0, r.new_tokens - 1) for r in runs) / wall if wall > 0 else 0.0


def aggregate(runs: list[Run]) -> list[Cell]:
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.temperature, r.category, r.label), []).append(r)
    cells = []
    for (temp, cat, label), rs in groups.items():
        tps, baseline = _tps(rs), groups.get((temp, cat, BASELINE), [])
        base, decode_base = _tps(baseline), _decode_tps(baseline)
        own = _tps(groups.get((temp, cat, rs[0].baseline), []))
        steps = sum(r.verify_steps for r in rs)
        drafted = sum(r.drafted for r in rs)
        ident = [r.identical for r in rs if r.identical is not None]
        itl = [g for r in rs for g in r.itl_s]
        cells.append(Cell(
            temp, cat, label, len(rs), sum(r.new_tokens for r in rs), tps,
            tps / base if base else 0.0, tps / own if own else 0.0,
            _decode_tps(rs) / decode_base if decode_base else 0.0,
            (sum(r.accepted for r in rs) + steps) / steps if drafted and steps else None,
            sum(r.accepted for r in rs) / drafted if drafted else None,
            statistics.median(r.ttft_s for r in rs), _quantile(itl, 0.5), _quantile(itl, 0.9),
            sum(ident) / len(ident) if ident else None))
    return cells + _means(cells)


def prefill_ceilings(runs: list[Run]) -> dict[str, float]:
    """Category (and MEAN) -> the baseline's wall / TTFT over its prompts: no drafter's
    end-to-end speedup can pass it (the prefill is the same work with or without one)."""
    sums: dict[str, list[float]] = {}
    for r in runs:
        if r.label == BASELINE:
            s = sums.setdefault(r.category, [0.0, 0.0])
            s[0], s[1] = s[0] + r.wall_s, s[1] + r.ttft_s
    out = {cat: wall / ttft for cat, (wall, ttft) in sums.items() if ttft > 0}
    spec = [x for cat, x in out.items() if cat not in OWN_FIGURE]
    if len(out) > 1 and spec:
        out[MEAN] = sum(spec) / len(spec)
    return out


def ceiling_line(ceilings: dict[str, float]) -> str:
    """The ceilings in words, lowest first (empty without any)."""
    if not ceilings:
        return ""
    lowest_first = sorted(ceilings.items(), key=lambda kv: kv[1])
    parts = ", ".join(f"{cat} {x:.2f}x" for cat, x in lowest_first)
    return ("prefill ceiling (plain wall / plain TTFT: the end-to-end speedup no drafter passes "
            f"here; `decode` is the drafter's own figure): {parts}")


def _means(cells: list[Cell]) -> list[Cell]:
    """The unweighted mean over categories (but OWN_FIGURE's), per (temperature, label)."""
    by: dict[tuple, list[Cell]] = {}
    for c in cells:
        by.setdefault((c.temperature, c.label), []).append(c)
    out = []
    for (temp, label), cs in by.items():
        if len(cs) < 2:
            continue
        cs = [c for c in cs if c.category not in OWN_FIGURE]
        if not cs:
            continue

        def mean(xs: Iterable[float | None]) -> float | None:
            xs = [x for x in xs if x is not None]
            return sum(xs) / len(xs) if xs else None

        out.append(Cell(
            temp, MEAN, label, sum(c.prompts for c in cs), sum(c.new_tokens for c in cs),
            mean(c.tokens_per_s for c in cs), mean(c.speedup for c in cs),
            mean(c.vs_own_plain for c in cs), mean(c.decode_speedup for c in cs),
            mean(c.mean_accepted_length for c in cs),
            mean(c.acceptance_rate for c in cs), statistics.median(c.ttft_s for c in cs),
            statistics.median(c.itl_p50_s for c in cs), statistics.median(c.itl_p90_s for c in cs),
            mean(c.identical for c in cs)))
    return out


COLUMNS = ("T", "category", "method", "n", "speedup", "vs own plain", "decode", "tok/s",
           "acc. len", "acc. rate", "TTFT s", "ITL p50 ms", "ITL p90 ms", "identical")


def rows(cells: list[Cell]) -> list[tuple[str, ...]]:
    """The report's rows, formatted (COLUMNS order): per temperature, categories as they came,
    the mean last, the baseline first in each category."""
    order = {c.category: i for i, c in enumerate(cells)}

    def opt(x, fmt):
        return "-" if x is None else format(x, fmt)

    return [(f"{c.temperature:g}", c.category, c.label, str(c.prompts), f"{c.speedup:.2f}x",
             f"{c.vs_own_plain:.2f}x", f"{c.decode_speedup:.2f}x", f"{c.tokens_per_s:.2f}",
             opt(c.mean_accepted_length, ".2f"), opt(c.acceptance_rate, ".2f"),
             f"{c.ttft_s:.2f}", f"{c.itl_p50_s * 1e3:.0f}", f"{c.itl_p90_s * 1e3:.0f}",
             opt(c.identical, ".2f"))
            for c in sorted(cells, key=lambda c: (c.temperature, c.category == MEAN,
                                                  order[c.category], c.label != BASELINE))]


def table(cells: list[Cell], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("category", "method") else "right")
    for row in rows(cells):
        t.add_row(*row)
    return t


NEAR_TIE = ("a margin within the runtime's batch-shape rounding, ~0.5 on llama.cpp, a few "
            "hundredths in bfloat16, is a near-tie; see the README, \"What lossless means here\"")
DIVERGENCE_HELP = ("greedy outputs not identical to plain decoding's: where each parts from it, "
                   f"and plain's logit margin there ({NEAR_TIE})")


def describe_divergence(d: dict, decode=None) -> str:
    """A `reference.divergence` in words; `decode` (ids -> text) shows the tokens."""
    def show(token: int | None) -> str:
        if token is None:
            return "(stopped)"
        return f"{token} {decode([token])!r}" if decode is not None else str(token)

    margin = ("one output stopped first" if d["logit_gap"] is None
              else f"plain's logit margin {d['logit_gap']:.3f}")
    return f"new token {d['at']}, plain {show(d['plain'])} vs {show(d['speculative'])}; {margin}"


def markdown(cells: list[Cell], title: str, divergent: list[str] = (),
             ceilings: dict[str, float] | None = None) -> str:
    """The same table as GitHub markdown (results.md), to paste into an issue or a README;
    then the prefill ceilings and the `divergences`, if any."""
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" if col in ("category", "method") else "--:" for col in COLUMNS)
             + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(cells)]
    if ceilings:
        line = ceiling_line(ceilings)
        lines += ["", line[0].upper() + line[1:] + "."]
    if divergent:
        lines += ["", DIVERGENCE_HELP[0].upper() + DIVERGENCE_HELP[1:] + ":", "",
                  *(f"- {n}" for n in divergent)]
    return "\n".join(lines) + "\n"


def divergences(runs: list[Run], decode=None) -> list[str]:
    """One line per greedy run that parted from plain."""
    return [f"{r.category}/{r.prompt_id}, {r.label}: {describe_divergence(r.divergence, decode)}"
            for r in runs if r.divergence is not None]


def summary(cells: list[Cell], ceilings: dict[str, float] | None = None) -> dict:
    """One line for scripts: per label, the speedup on each category and the mean; and the
    prefill ceilings, where given."""
    out: dict = {}
    one_temperature = len({c.temperature for c in cells}) == 1
    for c in cells:
        key = c.label if one_temperature else f"{c.label} T={c.temperature:g}"
        out.setdefault(key, {})[c.category] = round(c.speedup, 3)
    extra = {"prefill_ceiling": {k: round(v, 3) for k, v in ceilings.items()}} if ceilings else {}
    return {"speedup_vs_forerun_plain": out} | extra


def write_json(path: Path, meta: dict, cells: list[Cell], runs: list[Run]) -> None:
    path.write_text(json.dumps({"meta": meta, "cells": [asdict(c) for c in cells],
                                "prefill_ceiling": prefill_ceilings(runs),
                                "runs": [r.to_dict() for r in runs]}, indent=1))


def plot(path: Path, cells: list[Cell], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({c.temperature for c in cells})
    fig, axes = plt.subplots(len(temps), 1, figsize=(11, 4.2 * len(temps)), squeeze=False)
    for ax, temp in zip(axes[:, 0], temps, strict=True):
        cs = [c for c in cells if c.temperature == temp and c.label != BASELINE]
        cats = list(dict.fromkeys(c.category for c in cs))
        labels = list(dict.fromkeys(c.label for c in cs))
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            vals = {c.category: c.speedup for c in cs if c.label == label}
            decode = {c.category: c.decode_speedup for c in cs if c.label == label}
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(cats))]
            ax.bar(xs, [vals.get(cat, 0.0) for cat in cats], width, label=label,
                   hatch="//" if label.startswith(("hf", "llama.cpp")) else None)
            # the decode speedup (after the first token) as a tick on each bar
            marks = [(x, decode[cat]) for x, cat in zip(xs, cats, strict=True)
                     if decode.get(cat)]
            if marks:
                ax.hlines([y for _, y in marks], [x - width / 2 for x, _ in marks],
                          [x + width / 2 for x, _ in marks], color="black", lw=2, zorder=3,
                          label="decode speedup (after the first token)" if j == 0 else None)
        ax.axhline(1.0, color="black", lw=1, ls="--")
        top = max([1.0, *(c.speedup for c in cs), *(c.decode_speedup for c in cs)])
        ax.set_ylim(0, top * 1.25)  # room for the legend above the bars
        ax.set_xticks(range(len(cats)), cats)
        ax.set_ylabel("speedup vs forerun plain")
        ax.set_title(f"{title} (temperature {temp:g})")
        ax.legend(fontsize=8, ncols=min(4, len(labels)))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(path: Path, curves: dict[str, dict], title: str) -> None:
    """Forward time over new tokens, relative to one token, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, curve in curves.items():
        sizes, secs = curve["sizes"], curve["seconds"]
        ax.plot(sizes, [s / secs[0] for s in secs], marker="o",
                label=f"{name} (1 token: {secs[0] * 1e3:.0f} ms)")
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.set_xlabel("new tokens in one forward pass (context ~200)")
    ax.set_ylabel("time / time for 1 token")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
