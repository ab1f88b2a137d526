"""The training loop: collect (or reuse) the data, build the heads, train them, save them.

Owns: the heads' reduced vocabulary (`corpus_vocab`), their initialisation (`new_heads`, the
target layers each kind reads: `head_layers`), AdamW on a cosine schedule with resumable
checkpoints (`fit`, which `train` runs on the heads and `forerun.train.draft` on a
draft model), and `run`, the whole of `forerun train` below its flags. The data is
`collection`'s, the objective `losses`'.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from forerun.heads import HeadConfig, Heads, TargetIO, save_heads
from forerun.train.collection import collect
from forerun.train.config import TrainConfig
from forerun.train.losses import agreement, vocab_lookup, window_loss


def corpus_vocab(shards: list[dict], size: int, fallback: list[int], special: list[int],
                 ) -> torch.Tensor:
    """The heads' reduced vocabulary (FR-Spec / EAGLE-3): the `size` ids most frequent in the
    training data (its tokens and the target's argmax at every position), then, where the data
    has fewer distinct ids, `fallback`'s order; `special` ids always. Sorted."""
    counts = torch.bincount(torch.cat([torch.zeros(0, dtype=torch.long), *(
        ids for w in shards for ids in (w["tokens"].long(), w["top_ids"][:, 0].long()))]))
    seen = [int(i) for i in counts.argsort(descending=True, stable=True) if counts[i] > 0]
    chosen = dict.fromkeys(special)
    for i in [*seen, *fallback]:
        if len(chosen) >= max(size, len(special)):
            break
        chosen.setdefault(i)
    return torch.tensor(sorted(chosen))


def load_shards(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(str(p)) for p in paths]


CHECKPOINT_EVERY = 100  # steps between checkpoints (and at the last step)
WARMUP_STEPS = 20  # the learning rate's linear warm-up


def fit(module: torch.nn.Module, step_loss: Callable[[int], torch.Tensor], steps: int,
        cfg: TrainConfig, checkpoint: Path | None = None, desc: str = "train",
        progress: bool = True) -> float:
    """AdamW on `module`'s trainable parameters, warm-up then a cosine schedule over `steps`;
    step s minimises `step_loss(s)` (the caller makes step s's data depend on s alone, so a
    resumed run sees what an unbroken one would). The trainable parameters, optimizer and
    schedule go to `checkpoint` every CHECKPOINT_EVERY steps and at the last, and a run resumes
    from it. -> seconds spent training in this call."""
    torch.manual_seed(cfg.seed)
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    params = list(named.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS)
                                              * 0.5 * (1 + math.cos(math.pi * s / steps)))
    step = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)  # tensors and numbers: no pickled code
        module.load_state_dict(state["trainable"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step = state["step"]
    module.train()
    start = time.perf_counter()
    bar = tqdm(total=steps, initial=step, desc=desc, unit="step", disable=not progress)
    while step < steps:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = step_loss(step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        bar.update()
        if checkpoint is not None and (step % CHECKPOINT_EVERY == 0 or step == steps):
            trainable = {n: p.detach() for n, p in named.items()}
            torch.save({"trainable": trainable, "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "step": step}, checkpoint)
    bar.close()
    module.eval()
    return time.perf_counter() - start


def train(heads: Heads, shards: list[dict], cfg: TrainConfig, checkpoint: Path | None = None,
          progress: bool = True) -> dict:
    """The heads, trained on `shards` by `fit`; resumes from `checkpoint`."""
    # held_out = 0: agreement on the training windows themselves (a capacity check); else
    # every (1/held_out)-th window, so held-out text mixes chat and code as training does
    every = round(1 / cfg.held_out) if cfg.held_out > 0 and len(shards) > 1 else 0
    held = [w for i, w in enumerate(shards) if every and i % every == every - 1] or shards
    train_set = [w for i, w in enumerate(shards) if not every or i % every != every - 1] or shards
    lookup = vocab_lookup(heads)
    steps = cfg.total_steps(len(train_set))
    before = agreement(heads.eval(), held, cfg, lookup)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(cfg.seed))

    def step_loss(step: int) -> torch.Tensor:
        return window_loss(heads, train_set[int(order[step % len(train_set)])], cfg, lookup)[0]

    seconds = fit(heads, step_loss, steps, cfg, checkpoint, f"train {heads.cfg.kind}", progress)
    after = agreement(heads.eval(), held, cfg, lookup)
    return {"before": before, "after": after, "train_s": round(seconds, 1),
            "steps": steps, "windows": len(train_set), "held_out_windows": len(held)}


def new_heads(kind: str, io: TargetIO, vocab_ids: torch.Tensor, target_name: str,
              n_layers: int, **overrides) -> Heads:
    D = io.embed.shape[1]
    layers = head_layers(kind, n_layers)
    cfg = HeadConfig(kind, D, io.embed.shape[0], target_name, layers=layers,
                     draft_vocab=vocab_ids.shape[0], **overrides)
    torch.manual_seed(0)
    heads = Heads(cfg, vocab_ids, io)
    for name, p in heads.named_parameters():  # EAGLE's fc/layer: small random; Medusa: identity
        if p.dim() == 2 and not name.startswith("blocks"):
            torch.nn.init.normal_(p, 0, 0.02)
    return heads


def head_layers(kind: str, n_layers: int) -> tuple[int, ...]:
    """The target layers a kind reads: EAGLE-3 fuses low, middle and final features."""
    return (n_layers // 4, n_layers // 2, -1) if kind == "eagle3" else (-1,)


def run(engine, target_name: str, cfg: TrainConfig, out: Path, data_dir: Path,
        draft_vocab: int, replier=None, siblings: tuple[tuple[Path, int, bool], ...] = (),
        io: TargetIO | None = None, record: dict | None = None, **head_overrides) -> dict:
    """Collect (or reuse) the data, train, save; returns the report. `io`: the target's
    embeddings and LM head (default: the torch runtime's own); `record`: the data folder's
    manifest (`collection.manifest`)."""
    io = io or TargetIO(*(t.detach() for t in (engine.target.model.embed.weight,
                                                engine.target.model.lm_weight())))
    V = io.embed.shape[0]
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    layers = head_layers(cfg.kind, engine.target.config.n_layers)
    paths = collect(engine, cfg, layers, data_dir, replier, siblings, record)
    collect_s = time.perf_counter() - t0
    shards = load_shards(paths)
    tok = engine.tokenizer
    ids = (corpus_vocab(shards, draft_vocab, tok.frequent_ids(draft_vocab), tok.frequent_ids(1))
           if draft_vocab else torch.arange(V))
    heads = new_heads(cfg.kind, io, ids[ids < V], target_name, engine.target.config.n_layers,
                      **head_overrides)
    report = train(heads, shards, cfg, checkpoint=out / "checkpoint.pt")
    report |= {"collect_s": round(collect_s, 1), "data_tokens": sum(
        int(s["tokens"].shape[0]) for s in shards), "config": asdict(cfg)}
    heads.cfg = replace(heads.cfg, training=report)
    save_heads(heads, out)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
