"""The training objective: a head's predictions on one window against the target's distribution.

Owns: the heads' rolled-out predictions on a teacher-forced window (`predictions`: per head for
Medusa and Hydra, per step for EAGLE with its training-time test), the loss (cross-entropy to
the target's top-K distribution renormalised over the heads' reduced vocabulary: KL to the
target up to a constant, GKD-style distillation; EAGLE-1 adds its feature regression) and the
top-1/top-5 agreement with the target's argmax that `forerun train` reports. Pure: no model
runs, no file is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forerun.heads import Heads
from forerun.propose.heads import causal
from forerun.train.config import TrainConfig


def vocab_lookup(heads: Heads) -> torch.Tensor:
    """[V] each full-vocabulary id's index in the heads' reduced vocabulary, -1 outside it."""
    lookup = torch.full((heads.cfg.vocab_size,), -1, dtype=torch.long)
    lookup[heads.vocab_ids] = torch.arange(heads.vocab_ids.shape[0])
    return lookup


def teacher_probs(w: dict, rows: slice, lookup: torch.Tensor, n: int) -> torch.Tensor:
    """[R, N] the target's top-K distribution over the reduced vocabulary (renormalised)."""
    ids, lp = w["top_ids"][rows].long(), w["top_lp"][rows].float()  # [R, K]
    idx = lookup[ids]  # [R, K]; -1 = outside the reduced vocabulary
    p = lp.exp() * (idx >= 0)
    out = torch.zeros(ids.shape[0], n).scatter_add_(1, idx.clamp_min(0), p)
    return out / out.sum(-1, keepdim=True).clamp_min(1e-9)


def predictions(heads: Heads, w: dict, cfg: TrainConfig
                ) -> tuple[list[tuple[torch.Tensor, slice]], torch.Tensor]:
    """[(logits [R, N], teacher rows)] per head (medusa/hydra) or per rolled-out step (eagle):
    logits at row t predict the token that the target's distribution at row t + 1 + i is
    over; and an extra loss (EAGLE-1's feature regression, else 0)."""
    hc, x = heads.cfg, w["tokens"].long()
    T = x.shape[0]
    if hc.kind == "medusa":
        z = heads.medusa(w["h-1"].float())  # [K, T, D]
        return [(heads.logits(z[i, :T - 1 - i]), slice(1 + i, T))
                for i in range(hc.num_heads)], torch.zeros(())
    if hc.kind == "hydra":
        z, out = w["h-1"].float(), []
        for i in range(hc.num_heads):
            z = heads.hydra_step(i, z[:T - 1 - i], x[1 + i:])  # [T-1-i, D]
            out.append((heads.logits(z), slice(1 + i, T)))
        return out, torch.zeros(())
    feature = heads.feature({k: w[f"h{k}"] for k in hc.layers})  # [T, D]
    # both EAGLEs roll out cfg.ttt steps on their own outputs: drafting past the first token
    # feeds the head's output back in, and a head never trained on that input drafts nothing
    out, steps, extra = [], cfg.ttt, torch.zeros(())
    # Training-time test (EAGLE-3): step i's row t is the i-th draft from origin t, at position
    # t + i; it attends, as at draft time, to the true-feature entries of positions 0..t (step
    # 0's rows 0..t), to its own earlier drafts from t (steps 1..i-1, row t), and to itself.
    offsets: list[int] = []
    k_prev = v_prev = None
    for i in range(steps):
        n, start = T - 1 - i, sum(T - 1 - j for j in range(i))
        # a new cache per step, the earlier steps' entries copied in: autograd needs the
        # tensors an earlier step attended to unchanged
        k_cache, v_cache = heads.new_cache(start + n)
        if k_prev is not None:
            k_cache[:, :start], v_cache[:, :start] = k_prev[:, :start], v_prev[:, :start]
        if i == 0:
            mask = causal(0, n)
        else:
            mask = torch.zeros(n, start + n, dtype=torch.bool)
            mask[:, :T - 1] = torch.ones(n, T - 1, dtype=torch.bool).tril()
            rows = torch.arange(n)
            for offset in [*offsets[1:], start]:
                mask[rows, offset + rows] = True
        offsets.append(start)
        o = heads.eagle_step(feature[:n], x[1 + i:], torch.arange(i, i + n), k_cache, v_cache,
                             start, mask)  # [n, D]
        k_prev, v_prev = k_cache, v_cache
        out.append((heads.logits(o), slice(1 + i, T)))
        if hc.kind == "eagle" and i == 0:  # EAGLE-1 also regresses the next feature
            extra = 0.1 * F.smooth_l1_loss(o, w["h-1"][1:].float())
        feature = o[:-1]
    return out, extra


def window_loss(heads: Heads, w: dict, cfg: TrainConfig, lookup: torch.Tensor,
                ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Mean cross-entropy to the target over heads/steps, and (top1, top5, count) per head."""
    n, losses, agree = heads.vocab_ids.shape[0], [], []
    preds, extra = predictions(heads, w, cfg)
    for logits, rows in preds:
        target = teacher_probs(w, rows, lookup, n)  # [R, N]
        logq = logits.log_softmax(-1)
        losses.append(-(target * logq).sum(-1).mean())
        best = lookup[w["top_ids"][rows, 0].long()]  # [R] the target's argmax, -1 if outside
        top5 = logits.topk(min(5, n), dim=-1).indices  # [R, 5]
        agree.append((int((top5[:, 0] == best).sum()), int((top5 == best[:, None]).any(-1).sum()),
                      best.shape[0]))
    return torch.stack(losses).mean() + extra, agree


def agreement(heads: Heads, shards: list[dict], cfg: TrainConfig, lookup) -> dict:
    sums: list[list[int]] = []
    losses = []
    with torch.no_grad():
        for w in shards:
            loss, agree = window_loss(heads, w, cfg, lookup)
            losses.append(float(loss))
            for i, a in enumerate(agree):
                if i == len(sums):
                    sums.append([0, 0, 0])
                sums[i] = [s + v for s, v in zip(sums[i], a, strict=True)]
    return {"loss": sum(losses) / max(1, len(losses)),
            "top1": [round(s[0] / max(1, s[2]), 4) for s in sums],
            "top5": [round(s[1] / max(1, s[2]), 4) for s in sums]}
