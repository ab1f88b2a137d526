"""`forerun train early-exit --layer E`: the exit adapter, distilled from the target's logits.

Owns: the adapter's loss and training run. The data are the training package's
(`collection.collect`: the target's own greedy replies to the corpus's chat questions, then the
standard library's code, teacher-forced in windows), with the target's layer-E hidden state as
the feature (the output of block E-1, what the early-exit draft computes) and its top-K
next-token distribution as the teacher. The student is the draft's exit head: adapter, the
target's final norm and LM head (frozen), over the window's candidate tokens (the union of
every row's top K, the teacher renormalised over them: KL to the target up to a constant, as
the heads' loss). The loop is `loop.fit` (AdamW, warm-up and cosine, checkpoints).
Reported: the exit head's top-1 agreement with the target on held-out windows, before
(the identity adapter) and after.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from forerun.runtime.early_exit import ExitAdapter
from forerun.runtime.torch_model import TorchRuntime, rms_norm
from forerun.train.collection import collect
from forerun.train.config import TrainConfig
from forerun.train.loop import corpus_vocab, fit, load_shards


def feature_layer(layer: int) -> int:
    """The target layer index whose output is the draft's layer-E state: block E-1's."""
    return layer - 1


class ExitHead(torch.nn.Module):
    """The draft's exit head for training: the adapter (trained), the target's final norm and
    LM head rows (frozen, float32)."""

    def __init__(self, target: TorchRuntime, vocab: torch.Tensor | None = None):
        super().__init__()
        model = target.model
        self.adapter = ExitAdapter(target.config.dim, vocab)
        self.kept = None  # [V] bool: the tokens its vocab holds (None: every token)
        if vocab is not None:
            self.kept = torch.zeros(target.config.vocab_size, dtype=torch.bool)
            self.kept[vocab] = True
        self.norm = model.norm.detach().float()  # [D]
        self.lm = model.lm_weight().detach()  # [V, D] in the target's dtype
        self.eps = target.config.norm_eps

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [T, D] layer-E states -> logits [T, U] over the token ids [U]."""
        x = rms_norm(self.adapter(h.float()), self.norm, self.eps)  # [T, D]
        return x @ self.lm[ids].float().T  # [T, U]


def window_loss(head: ExitHead, w: dict, layer: int) -> tuple[torch.Tensor, float]:
    """(cross-entropy to the teacher's top-K renormalised over the window's candidates,
    top-1 agreement with the teacher's argmax) on one window."""
    h = w[f"h{feature_layer(layer)}"]  # [T, D]
    top_ids, top_lp = w["top_ids"].long(), w["top_lp"].float()  # [T, K]
    ids, index = top_ids.unique(return_inverse=True)  # [U], [T, K]
    weights = top_lp.exp() if head.kept is None else top_lp.exp() * head.kept[top_ids]
    p = torch.zeros(h.shape[0], ids.shape[0]).scatter_add_(1, index, weights)  # [T, U]
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    logits = head(h, ids)  # [T, U]
    if head.kept is not None:  # tokens outside its vocab: never the exit head's
        outside = ~head.kept[ids]  # [U]
        logits = logits.masked_fill(outside, float("-inf"))
        logp = logits.log_softmax(-1).masked_fill(outside, 0.0)  # p is 0 there: no 0 * -inf
    else:
        logp = logits.log_softmax(-1)  # [T, U]
    loss = -(p * logp).sum(-1).mean()
    agree = (ids[logits.argmax(-1)] == top_ids[:, 0]).float().mean().item()
    return loss, agree


@torch.no_grad()
def agreement(head: ExitHead, shards: list[dict], layer: int) -> float:
    """Top-1 agreement with the target over the shards' rows (candidates: each window's)."""
    scores = [(window_loss(head, w, layer)[1], w["top_ids"].shape[0]) for w in shards]
    return sum(a * n for a, n in scores) / max(1, sum(n for _, n in scores))


def train_adapter(target: TorchRuntime, shards: list[dict], layer: int, cfg: TrainConfig,
                  checkpoint: Path | None = None, progress: bool = True,
                  vocab: torch.Tensor | None = None) -> tuple[ExitAdapter, dict]:
    """The adapter (scoring the tokens `vocab`, None = all) trained on `shards` (every tenth
    held out) -> it and the report."""
    every = round(1 / cfg.held_out) if cfg.held_out > 0 and len(shards) > 1 else 0
    held = [w for i, w in enumerate(shards) if every and i % every == every - 1] or shards
    train_set = [w for i, w in enumerate(shards) if not every or i % every != every - 1] or shards
    head = ExitHead(target, vocab)
    before = agreement(head, held, layer)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))
    steps = cfg.total_steps(len(train_set))

    def step_loss(step: int) -> torch.Tensor:
        return window_loss(head, train_set[int(order[step % len(train_set)])], layer)[0]

    seconds = fit(head, step_loss, steps, cfg, checkpoint, f"train early-exit {layer}", progress)
    after = agreement(head, held, layer)
    return head.adapter, {"layer": layer, "before": round(before, 4), "after": round(after, 4),
                          "train_s": round(seconds, 1), "steps": steps,
                          "windows": len(train_set), "held_out_windows": len(held)}


def run(engine, layer: int, cfg: TrainConfig, data_dir: Path, replier=None,
        record: dict | None = None, vocab_size: int = 0) -> tuple[ExitAdapter, dict]:
    """Collect (or reuse) the data with the layer-E features, train -> adapter, report.
    `vocab_size`: the exit head scores the most frequent tokens of the data only (0 = all)."""
    target = engine.target
    n = target.config.n_layers
    if not 0 < layer < n:
        raise ValueError(f"--layer must lie in 1..{n - 1} (of {n} layers), got {layer}")
    t0 = time.perf_counter()
    paths = collect(engine, cfg, (feature_layer(layer),), data_dir, replier=replier,
                    record=record)
    collected = time.perf_counter() - t0
    shards, tok = load_shards(paths), engine.tokenizer
    vocab = (corpus_vocab(shards, vocab_size, tok.frequent_ids(vocab_size), tok.frequent_ids(1))
             if vocab_size else None)
    vocab = None if vocab is None else vocab[vocab < target.config.vocab_size]
    adapter, report = train_adapter(target, shards, layer, cfg,
                                    data_dir / f"early-exit-{layer}-{vocab_size}.ckpt",
                                    vocab=vocab)
    return adapter, {**report, "vocab": vocab_size, "collect_s": round(collected, 1),
                     "data": str(data_dir)}


