"""Measuring a runtime's forward-time curve: seconds for one forward pass over n new tokens.

Owns: `ForwardCurve` (measured points, interpolated between them) and its measurement, which
works on any Runtime because it only appends tokens, times the forward pass and truncates.
The cost-model length policy reads these curves: the target's curve prices a verify step over
k+1 tokens, the draft's curve at one token prices each drafted token.

Invariants: measurement leaves the runtime empty (length 0), so callers must measure before a
generation, never inside one. `calibrated_curve` measures each runtime object once, at its first
use, and keeps the curve in the runtime's own `curve` slot (no cache here: it lives as long as
the runtime); that first use pays a few dozen
forward passes (CALIBRATION_REPS + CALIBRATION_WARMUP per size), which the CLI's --compare and
`forerun bench` spend in their untimed warm-up runs. A runtime whose capabilities say
`curve_on_disk` has a `calibration_key()` (the
llama.cpp one: model file, build, threads, machine) and also finds and keeps its curve on disk,
`$FORERUN_HOME/curves/`, for CURVE_MAX_AGE_S: a new process skips those passes (~13 s for the
default target on 2 cores). FORERUN_CURVE_CACHE=0 turns that off. A stale curve prices drafts
a little wrong; it never changes what is generated.
The curve `calibrated_curve` hands out is a `LiveCurve`: the decode loop shows it each verify
pass it times (`observe_pass`), and each size it has seen is priced at its calibration times the
running ratio of seen to calibrated seconds. A curve measured while the machine was busy (a
one-token pass slowed more than a longer one makes every draft look cheap) is corrected by the
passes that follow, in every process that loads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter

import torch

from forerun.runtime.base import Runtime

FILLER_SEED = 0  # the context tokens are a fixed pseudo-random sequence: any ids time the same
CALIBRATION_CONTEXT = 200  # cached tokens in front of the timed ones, as in a short chat
# timed forwards per size at first use; the fastest is kept: a busy machine only ever adds time,
# and one slow one-token pass would make every longer verify look cheap (drafting at a loss)
CALIBRATION_REPS = 5
CALIBRATION_WARMUP = 1  # untimed forwards per size first (allocator, kernel selection)
DENSE_SIZES = 4  # calibrate every size up to this, then doubling sizes and the largest one
CURVE_MAX_AGE_S = 24 * 3600  # a curve cached on disk is measured again after this
# LiveCurve: a size's ratio of seen to calibrated seconds is the mean of its first 1/LIVE_WEIGHT
# passes, then a running average giving the newest this weight; one pass moves it at most
# LIVE_CLIP-fold (a pass stalled by the machine is not a new speed)
LIVE_WEIGHT = 0.1
LIVE_CLIP = 2.0


@dataclass(frozen=True)
class ForwardCurve:
    """Seconds per forward pass at measured sizes (strictly increasing numbers of new tokens).

    Between sizes: linear interpolation; below the first size: its time (a forward is never
    cheaper than the smallest one measured); beyond the last size: the last segment's slope,
    never negative (more tokens never take less time); a single measured size is a flat curve.
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError(f"need one time per size, got {self.sizes} and {self.seconds}")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError(f"sizes must be strictly increasing, got {self.sizes}")

    def __call__(self, n_tokens: float) -> float:
        sizes, seconds = self.sizes, self.seconds
        if n_tokens <= sizes[0] or len(sizes) == 1:
            return seconds[0]
        if n_tokens > sizes[-1]:
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
            return seconds[-1] + max(slope, 0.0) * (n_tokens - sizes[-1])
        i = bisect_right(sizes, n_tokens)  # sizes[i-1] <= n_tokens < sizes[i], or n = the last
        i = min(i, len(sizes) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return seconds[i - 1] + slope * (n_tokens - sizes[i - 1])

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}


def measure_forward_curve(runtime: Runtime, sizes: tuple[int, ...] = (1, 2, 4, 8, 16),
                          context: int = CALIBRATION_CONTEXT, reps: int = 5,
                          warmup: int = 1, statistic=statistics.median) -> ForwardCurve:
    """Time one forward over `size` new tokens after `context` cached ones, for each size.

    The context shrinks to fit the cache if it must. Passes run in rounds over all sizes (so a
    slow spell of the machine touches every size, not one), `warmup` untimed rounds first; each
    size keeps `statistic` (median; min for calibration) of its `reps` timed passes. The cache
    is truncated back to the context between passes, and to 0 at the end.
    """
    sizes = tuple(sorted(set(sizes)))
    if not sizes or sizes[0] < 1 or sizes[-1] > runtime.capacity:
        raise ValueError(f"sizes must lie in 1..{runtime.capacity} (the capacity), got {sizes}")
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got {reps} and {warmup}")
    context = max(0, min(context, runtime.capacity - sizes[-1]))
    filler = torch.Generator().manual_seed(FILLER_SEED)
    ids = torch.randint(runtime.config.vocab_size, (context + sizes[-1],), generator=filler)
    runtime.truncate(0)
    try:
        if context:
            runtime.forward(ids[:context], last_only=True)
        times: list[list[float]] = [[] for _ in sizes]
        for rep in range(warmup + reps):
            for i, size in enumerate(sizes):
                start = perf_counter()
                runtime.forward(ids[context:context + size])  # logits for every token, as verify
                elapsed = perf_counter() - start
                runtime.truncate(context)
                if rep >= warmup:
                    times[i].append(elapsed)
        seconds = [statistic(t) for t in times]
    finally:
        runtime.truncate(0)
    return ForwardCurve(sizes, tuple(seconds))


class LiveCurve:
    """A calibrated ForwardCurve corrected by the passes it has been shown (`observe`).

    Each size seen keeps a ratio seen / calibrated seconds; a size not seen takes the ratio
    interpolated between the nearest seen sizes (the nearest one's past either end), so with
    one size seen the whole curve scales by its ratio and its shape stays the calibration's.
    """

    def __init__(self, base: ForwardCurve):
        self.base = base
        self.sizes, self.seconds = base.sizes, base.seconds  # the calibration's points
        self._ratio: dict[int, float] = {}  # size seen -> running seen / calibrated seconds
        self._count: dict[int, int] = {}
        self._seen: list[int] = []  # the sizes seen, sorted

    def observe(self, n_tokens: int, seconds: float) -> None:
        """One timed forward pass over n_tokens new tokens."""
        calibrated = self.base(n_tokens)
        if n_tokens < 1 or seconds <= 0 or calibrated <= 0:
            return
        count = self._count.get(n_tokens, 0) + 1
        old = self._ratio.get(n_tokens, 1.0)
        ratio = min(max(seconds / calibrated, old / LIVE_CLIP), old * LIVE_CLIP)
        self._ratio[n_tokens] = old + max(LIVE_WEIGHT, 1 / count) * (ratio - old)
        self._count[n_tokens] = count
        if count == 1:
            self._seen = sorted(self._ratio)

    def ratio(self, n_tokens: float) -> float:
        """Seen / calibrated seconds at n_tokens (1 before any pass was seen)."""
        seen = self._seen
        if not seen:
            return 1.0
        i = bisect_right(seen, n_tokens)
        if i == 0:
            return self._ratio[seen[0]]
        if i == len(seen) or seen[i - 1] == n_tokens:
            return self._ratio[seen[i - 1]]
        lo, hi = seen[i - 1], seen[i]
        t = (n_tokens - lo) / (hi - lo)
        return self._ratio[lo] + t * (self._ratio[hi] - self._ratio[lo])

    def __call__(self, n_tokens: float) -> float:
        return self.base(n_tokens) * self.ratio(n_tokens)

    def to_dict(self) -> dict:
        return {**self.base.to_dict(),
                "seen": {n: [round(self._ratio[n], 4), self._count[n]] for n in self._seen}}


def observe_pass(runtime: Runtime, n_tokens: int, seconds: float) -> None:
    """Show the runtime's calibrated curve (if it has one) a timed verify pass."""
    if runtime.curve is not None:
        runtime.curve.observe(n_tokens, seconds)


def calibration_sizes(max_tokens: int) -> tuple[int, ...]:
    """1..DENSE_SIZES, then doubling sizes, then `max_tokens`: dense where draft lengths live."""
    sizes, n = set(range(1, min(DENSE_SIZES, max_tokens) + 1)), DENSE_SIZES
    while n < max_tokens:
        sizes.add(n)
        n *= 2
    return tuple(sorted(sizes | {max_tokens}))


def cached_curve(runtime: Runtime) -> LiveCurve | None:
    """The curve `calibrated_curve` measured for this runtime, if it has."""
    return runtime.curve


def calibrated_curve(runtime: Runtime, max_tokens: int) -> LiveCurve:
    """The runtime's curve up to `max_tokens`, measured at its first use and then kept in its
    `curve` slot, corrected by the passes the decode loop shows it since (`observe_pass`).

    Measures again (and replaces the kept curve, and what it had seen) only when a larger
    size is asked for. Empties the runtime's cache when it measures.
    """
    max_tokens = min(max_tokens, runtime.capacity)
    curve = runtime.curve
    if curve is None or curve.sizes[-1] < max_tokens:
        key = _disk_key(runtime)
        curve = _load_curve(key, max_tokens) if key else None
        if curve is None:
            curve = measure_forward_curve(runtime, calibration_sizes(max_tokens),
                                          reps=CALIBRATION_REPS, warmup=CALIBRATION_WARMUP,
                                          statistic=min)
            if key:
                _save_curve(key, curve)
        curve = runtime.curve = LiveCurve(curve)
    return curve


def _disk_key(runtime: Runtime) -> dict | None:
    """The runtime's key for the disk cache, or None (no key, or FORERUN_CURVE_CACHE=0)."""
    if os.environ.get("FORERUN_CURVE_CACHE", "1") == "0" or not runtime.capabilities.curve_on_disk:
        return None
    from forerun import __version__

    return {**runtime.calibration_key(), "forerun": __version__, "reps": CALIBRATION_REPS,
            "context": CALIBRATION_CONTEXT}


def _curve_file(key: dict) -> Path:
    from forerun.models.catalog import forerun_home

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return forerun_home() / "curves" / f"{digest}.json"


def _load_curve(key: dict, max_tokens: int) -> ForwardCurve | None:
    """The curve cached under `key`, if it reaches max_tokens and is young enough."""
    try:
        saved = json.loads(_curve_file(key).read_text())
        curve = ForwardCurve(tuple(saved["sizes"]), tuple(saved["seconds"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    fresh = 0 <= time.time() - saved.get("measured", 0) < CURVE_MAX_AGE_S
    return curve if saved.get("key") == key and fresh and curve.sizes[-1] >= max_tokens else None


def _save_curve(key: dict, curve: ForwardCurve) -> None:
    """Keep the curve on disk (atomically: a concurrent reader sees the old file or this)."""
    path = _curve_file(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **curve.to_dict(), "measured": time.time()}))
        tmp.replace(path)
    except OSError:  # a read-only home: measure each time, as before
        pass
