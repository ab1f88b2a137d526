"""Log-probabilities from a target pass's raw logits: what `logprobs` and `echo` report.

Owns the arithmetic only: the log-softmax of the target's raw rows (before penalties,
temperature and grammar masks, as OpenAI's and vLLM's logprobs are), in float64 on the host,
each token's value and its row's likeliest alternatives. Which rows belong to which token is
the batch step's business (`forerun.batch_engine`). Pure.
"""

from __future__ import annotations

import torch

from forerun.metrics import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Token i's logprob under row i of `logits` [n, V] (raw), with that row's `top_n`
    likeliest alternatives, most likely first; rows past len(tokens) are ignored."""
    logp = logits[:len(tokens)].double().log_softmax(-1).cpu()  # [n, V]
    chosen = logp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    top = logp.topk(top_n, -1) if top_n else None
    return [TokenLogprob(t, lp, () if top is None else tuple(zip(
        top.indices[i].tolist(), top.values[i].tolist(), strict=True)))
        for i, (t, lp) in enumerate(zip(tokens, chosen, strict=True))]
