"""Early-exit self-speculation (LayerSkip, Elhoushi et al. 2024): the target's first E layers
draft for it, and their K/V are the target's own.

Owns: the method's options (`EarlyExitConfig`: the exit layer E and the adapter), the default
E for a model nobody swept (`default_layer`), where a trained adapter is kept (`adapter_file`:
one safetensors per model file and E under forerun_home()/early-exit, keyed by the file's
path, size and mtime, beside the layer-skip sets) and the proposer. Drafting is the
draft-model method's (`DraftModelProposer`: autoregressive, q under the same sampling settings)
over `ExitDraft`, the target's first E blocks plus the exit head.

KV reuse: the draft writes the target's own cache at layers 0..E-1 (a sequence decoded
alone: the target's cache; a batch member: its region of the batch's pool, where the batch
runtime declares `resume_rows`, `BATCH_TARGET`), and its draft carries the layer-E states of
the rows it ran (`Draft.resume`): the pending token and every drafted token but the last. The
verify pass computes layers E.. for them and all layers for the last one only (in a batch,
beside the other members' rows, which run every layer); rollback is the target's, rejected
slots are overwritten. A batch whose runtime cannot resume rows gives a member a cache of its
own (the prompt fed through E layers too) and a verify of every layer: the same output,
without the saving. Training the adapter is `forerun.train.early_exit`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch

from forerun.models.catalog import forerun_home
from forerun.propose.base import BATCH_TARGET, Draft, Needs, ProposerContext
from forerun.propose.draft_model import DraftModelProposer, RootRow
from forerun.runtime.base import Runtime
from forerun.runtime.early_exit import ExitAdapter, ExitDraft
from forerun.runtime.torch_model import TorchRuntime

STORE = "early-exit"  # the ProposerContext.stores key prefix of a sequence's draft
ADAPTER_DIR = "early-exit"  # under forerun_home(): one safetensors per model file and layer
# E = this share of the layers (8 of the default target's 28): the sweep's pick, the cheapest
# exit whose trained adapter can pay (docs/results/2026-12-05-early-exit.md)
DEFAULT_FRACTION = 0.29
NO_ADAPTER = "none"


@dataclass(frozen=True)
class EarlyExitConfig:
    """E, the layers the draft runs (None = `default_layer`), and the exit adapter: a
    safetensors file, `none` (the identity), or None (the one trained for the target's file
    and E, else the identity)."""

    layer: int | None = None
    adapter: str | None = None

    def __post_init__(self):
        if self.layer is not None and self.layer < 1:
            raise ValueError(f"early-exit: the exit layer must be >= 1, got {self.layer}")

    def resolve_layer(self, n_layers: int) -> int:
        return self.layer if self.layer is not None else default_layer(n_layers)

    def resolve_adapter(self, target: TorchRuntime, layer: int) -> ExitAdapter | None:
        if self.adapter == NO_ADAPTER:
            return None
        if self.adapter is not None:
            return load_adapter(Path(self.adapter).expanduser(), target.config.dim, layer)
        saved = None if target.source is None else adapter_file(target.source, layer)
        return (load_adapter(saved, target.config.dim, layer)
                if saved is not None and saved.is_file() else None)


def default_layer(n_layers: int) -> int:
    """E for a model nobody chose one for: DEFAULT_FRACTION of its layers (8 of 28)."""
    return max(1, min(n_layers - 1, round(DEFAULT_FRACTION * n_layers)))


def adapter_file(source: Path, layer: int) -> Path:
    """Where the adapter trained for the weights file `source` at exit layer `layer` is kept."""
    stat = source.stat()
    key = json.dumps([str(source.resolve()), stat.st_size, stat.st_mtime_ns])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return forerun_home() / ADAPTER_DIR / f"{source.stem}-{digest}-exit{layer}.safetensors"


def save_adapter(path: Path, adapter: ExitAdapter, layer: int, record: dict) -> Path:
    """Write the adapter (float32) with its layer and what training measured (`record`)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"layer": str(layer), "record": json.dumps(record)}
    tensors = {"weight": adapter.weight.detach().float().contiguous()}
    if adapter.vocab is not None:
        tensors["vocab"] = adapter.vocab.long().contiguous()
    save_file(tensors, str(path), metadata=meta)
    return path


def load_adapter(path: Path, dim: int, layer: int) -> ExitAdapter:
    """The adapter in `path`, which must fit a model of width `dim` at exit layer `layer`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            weight, meta = f.get_tensor("weight"), f.metadata() or {}
            names = f.keys()  # a safe_open has no __contains__
            vocab = f.get_tensor("vocab") if "vocab" in names else None
    except (OSError, KeyError, SafetensorError) as e:
        raise ValueError(f"{path}: not an early-exit adapter ({e})") from e
    if tuple(weight.shape) != (dim, dim) or meta.get("layer") != str(layer):
        raise ValueError(f"{path}: an adapter for exit layer {meta.get('layer')} and width "
                         f"{weight.shape[-1]}, not layer {layer} and width {dim}")
    adapter = ExitAdapter(dim, vocab)
    with torch.no_grad():
        adapter.weight.copy_(weight)
    return adapter


class EarlyExitProposer(DraftModelProposer):
    """The draft-model method whose draft is `ExitDraft`; over the target's own cache
    (`view.shared`: alone, or a batch member's pool region) its drafts carry the rows the
    verify pass resumes at layer E."""

    name = "early-exit"

    def __init__(self, view: ExitDraft, target: Runtime):
        super().__init__(view, target.config.vocab_size)
        self.view, self.target = view, target
        self.needs = Needs(grammar=True, shared_store=True, resume=view.shared,
                           target_region=view.shared)

    def prefill(self, prompt: list[int]) -> None:
        if not self.view.shared:  # a cache of its own: the prompt through E layers
            super().prefill(prompt)
            return
        self.prompt_length, self.root = len(prompt), RootRow()

    def bind(self, seq: int) -> None:
        """A batch member's: its cache is the pool's region `seq` (at each admission)."""
        self.view.bind(seq)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        if not self.view.shared:
            return super().propose(tokens, k, sampling, generator)
        base = len(tokens) - 1  # the pending token's slot
        if self.view.target_length != base:
            raise RuntimeError(f"early-exit drafts over its target's cache, which holds "
                               f"{self.view.target_length} tokens, not the {base} before the "
                               "pending one")
        self.view.align(base)
        self.root = RootRow()  # each draft runs its own rows: the verify resumes them
        draft = super().propose(tokens, k, sampling, generator)
        return replace(draft, resume=self.view.resume()) if len(draft.tokens) else draft


def early_exit_proposer(cfg: EarlyExitConfig, ctx: ProposerContext) -> EarlyExitProposer:
    """A proposer for one sequence of ctx.target; its draft is built once per store (a
    sequence's: an Engine's own, or a batch member's) and reused by later proposers. A batch
    member drafts in its pool region where the batch's runtime resumes rows (ctx.batch's
    BATCH_TARGET), else over a cache of its own."""
    target = ctx.target
    if not target.capabilities.resume_rows:
        raise ValueError("method 'early-exit' drafts with the target's own first layers and "
                         "cache: --runtime torch (llama.cpp cannot)")
    torch_target = cast(TorchRuntime, target)
    layer = cfg.resolve_layer(target.config.n_layers)
    pool = None if ctx.batch is None else ctx.batch.get(BATCH_TARGET)
    shared = ctx.batch is None or pool is not None
    key = f"{STORE}:{layer}:{cfg.adapter}:{shared}:{ctx.capacity}:{id(pool)}"
    if key not in ctx.stores:
        adapter = cfg.resolve_adapter(torch_target, layer)
        ctx.stores[key] = ExitDraft(torch_target, layer, adapter, shared, ctx.capacity, pool)
    return EarlyExitProposer(ctx.stores[key], target)
