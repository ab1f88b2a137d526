"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft tokens so that the
output is distributed exactly as the target's samples. Pure functions.

Vocabulary (as in the papers and vLLM):
- p: the target's distribution at each draft position plus one more, [K+1, V];
- q: the draft's distribution at each draft position, [K, V]; None means the drafter is
  deterministic (n-gram lookup), i.e. q is one-hot on the drafted token;
- accepted tokens: draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
  stopping at the first rejection;
- recovered token: at the first rejection i, a token drawn from norm(max(0, p_i - q_i));
- bonus token: when all K are accepted, a token drawn from p_K.
Every verify step therefore yields accepted + 1 tokens. With temperature 0, p is one-hot, so a
draft token is accepted iff it is the target's argmax and the recovered token is that argmax:
greedy verification is the T = 0 case of the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.sampling import sample


@dataclass(frozen=True)
class Verdict:
    tokens: list[int]  # the accepted draft tokens, then the recovered or bonus token
    num_accepted: int  # 0..K


def rejection_sample(
    draft_tokens: torch.Tensor,  # [K] int64
    p: torch.Tensor,  # [K+1, V] target probabilities
    q: torch.Tensor | None,  # [K, V] draft probabilities; None = one-hot on draft_tokens
    generator: torch.Generator,
) -> Verdict:
    K = draft_tokens.shape[0]
    rows = torch.arange(K, device=p.device)
    p_x = p[rows, draft_tokens]  # [K]
    q_x = q[rows, draft_tokens] if q is not None else torch.ones_like(p_x)  # [K]
    u = torch.rand(K, generator=generator, dtype=p.dtype, device=p.device)  # [K]
    accepted = u * q_x < p_x  # [K]; u < p/q without dividing by q
    rejected_at = (~accepted).nonzero()
    n = int(rejected_at[0]) if rejected_at.numel() else K
    if n == K:
        last = sample(p[K], generator)  # bonus
    else:
        q_n = q[n] if q is not None else torch.zeros_like(p[n]).index_fill_(0, draft_tokens[n], 1)
        residual = (p[n] - q_n).clamp_min(0)  # [V]
        total = residual.sum()
        # total == 0 only when p_n == q_n, where rejection has probability 0; guard anyway.
        last = sample(residual / total if total > 0 else p[n], generator)  # recovered
    return Verdict(tokens=[*draft_tokens[:n].tolist(), int(last)], num_accepted=n)
