"""Layer-skip self-speculation (Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024): the
target drafts for itself with a set of its layers left out. No extra weights: the draft runs
the target's own modules and parameters (shared, never copied), minus the skipped layers.

Owns: the skip set (`LayerSkipConfig`: given as `3,5,7-12` or the JSON file `forerun tune
layer-skip` wrote), where a tuned set is kept (`tuned_file`: one small JSON per model file
under forerun_home()/layer-skip, keyed by the file's path, size and mtime), the fallback set for
a model nobody tuned (`default_skip`), and the proposer. Drafting is the draft-model method's
(`DraftModelProposer`) over `TorchRuntime.without_layers`: a runtime with a KV cache of its own
over the kept layers, since skipping a layer changes every later layer's input (the target's
K/V past the first skipped layer are not the draft's). The search for a set is
`forerun.tune.layer_skip`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from forerun.models.catalog import forerun_home
from forerun.propose.base import Needs
from forerun.propose.draft_model import DraftModelProposer
from forerun.runtime.base import Runtime

STORE = "layer-skip"  # the ProposerContext.stores key prefix of a sequence's skipped runtime
TUNED_DIR = "layer-skip"  # under forerun_home(): one JSON per tuned model file


class SkippingRuntime(Runtime, Protocol):
    """A runtime whose `capabilities.skip_layers` is set (the torch runtime)."""

    source: Path | None  # the weights' file: tuned sets are kept per file

    def without_layers(self, skip: tuple[int, ...], capacity: int | None = None) -> Runtime:
        """The same model without the layers `skip`, over the same weights, with an empty
        cache of its own."""
        ...


@dataclass(frozen=True)
class LayerSkipConfig:
    """The layers the draft leaves out; None = the set tuned for the target's file, else
    `default_skip`."""

    skip: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.skip is not None and any(i < 0 for i in self.skip):
            raise ValueError(f"layer-skip: layer indices must be >= 0, got {list(self.skip)}")

    def resolve(self, target: Runtime) -> tuple[int, ...]:
        """The set to skip in this target: the given one, the tuned one, or the default."""
        if self.skip is not None:
            return self.skip
        tuned = (load_tuned(cast(SkippingRuntime, target).source)
                 if target.capabilities.skip_layers else None)
        return tuned if tuned is not None else default_skip(target.config.n_layers)


def default_skip(n_layers: int) -> tuple[int, ...]:
    """Every other layer of the middle half (odd indices), for a model nobody tuned: Draft &
    Verify found the middle layers the most redundant, the first and last the least."""
    return tuple(i for i in range(n_layers // 4, n_layers - n_layers // 4) if i % 2)


def parse_layers(text: str) -> tuple[int, ...]:
    """`3,5,7-12` (ranges inclusive; empty = none), or the path of a JSON file with a `skip`
    list (what `forerun tune layer-skip` writes) -> the sorted layer indices."""
    path = Path(text).expanduser()
    if text.endswith(".json") or path.is_file():
        try:
            return tuple(sorted({int(i) for i in json.loads(path.read_text())["skip"]}))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{text}: not a layer-skip file ({e})") from e
    layers: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        if not (first.isdigit() and (not dash or last.isdigit())):
            raise ValueError(f"layer-skip: expected layers such as 3,5,7-12, got {text!r}")
        layers.update(range(int(first), int(last if dash else first) + 1))
    return tuple(sorted(layers))


def format_layers(layers: tuple[int, ...]) -> str:
    """The inverse of parse_layers: runs of consecutive layers as ranges (`3,5,7-12`)."""
    runs: list[list[int]] = []
    for i in sorted(layers):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def tuned_file(source: Path) -> Path:
    """Where the set tuned for the weights file `source` is kept."""
    stat = source.stat()
    key = json.dumps([str(source.resolve()), stat.st_size, stat.st_mtime_ns])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return forerun_home() / TUNED_DIR / f"{source.stem}-{digest}.json"


def save_tuned(source: Path, record: dict) -> Path:
    """Keep a tuned set (`record["skip"]`, with whatever the search measured) for `source`
    (atomically: a concurrent reader sees the old file or this one) -> the file."""
    path = tuned_file(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"model": str(source), **record}, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_tuned(source: Path | None) -> tuple[int, ...] | None:
    """The set tuned for `source`, if one was saved (None: no file, or no source)."""
    if source is None or not source.is_file():
        return None
    path = tuned_file(source)
    return parse_layers(str(path)) if path.is_file() else None


class LayerSkipProposer(DraftModelProposer):
    """The draft-model method whose draft is the target without some of its layers."""

    name = "layer-skip"
    needs = Needs(grammar=True, shared_store=True)  # its skipped runtime is kept in the stores


def layer_skip_proposer(cfg: LayerSkipConfig, target: Runtime, capacity: int | None,
                        stores: dict) -> LayerSkipProposer:
    """A proposer for one sequence of `target`; its skipped runtime is built once per store
    (a sequence's: an Engine's own, or a batch member's) and reused by later proposers."""
    if not target.capabilities.skip_layers:
        raise ValueError("method 'layer-skip' needs a runtime that can run the target without "
                         "some of its layers: --runtime torch (llama.cpp cannot)")
    skip = cfg.resolve(target)
    key = f"{STORE}:{format_layers(skip)}:{capacity}"
    if key not in stores:
        stores[key] = cast(SkippingRuntime, target).without_layers(skip, capacity)
    return LayerSkipProposer(stores[key], target.config.vocab_size)
