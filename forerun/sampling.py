"""Logits -> probabilities -> tokens. Pure functions; randomness comes in as a torch.Generator.

Owns: the sampling configuration and its validation, the temperature / top-k / top-p / min-p
transforms, and drawing a token. Temperature 0 is greedy: the distribution is one-hot on the
argmax (first index on ties), so greedy decoding is the T = 0 case of everything downstream,
rejection sampling included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class SamplingError(ValueError):
    """An invalid sampling parameter."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0 <= self.min_p < 1):
            raise SamplingError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def logits_to_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities under the sampling configuration."""
    if cfg.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # shift first: a tiny temperature would overflow the raw logits to inf (and softmax to nan)
    # (and one below the dtype's smallest normal would round to 0)
    temperature = max(cfg.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [..., V] mass of strictly better tokens
        drop_sorted = mass_before >= cfg.top_p  # always keeps the top token
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    if cfg.min_p > 0:
        probs = probs.masked_fill(probs < cfg.min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """One token from a row of logits [V]: `sample(logits_to_probs(...))`, and at temperature 0
    the argmax (first index on ties) directly, as that one-hot row would draw."""
    if cfg.greedy:
        return int(logits.argmax(-1))
    return int(sample(logits_to_probs(logits, cfg), generator))


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row: [..., V] -> [...] int64. Rows need not sum to exactly 1."""
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]
    if bool((flat.count_nonzero(-1) == 1).all()):
        # one-hot rows (greedy; a filter that leaves one token): the only token that can be
        # drawn, without a pass over the vocabulary (multinomial took 3.4 ms a row for Qwen's
        # 151,936 ids here, ~8% of a llama.cpp decode step; the check costs 0.1 ms)
        return flat.argmax(-1).reshape(probs.shape[:-1])
    # inverse CDF: one uniform per row instead of multinomial's V exponential draws (1.0 vs
    # 3.1 ms a row for V = 151,936 here). x lies in (0, total]; token i is drawn iff
    # cdf[i-1] < x <= cdf[i], an interval of length p_i, so a zero-mass token is never drawn
    # and the index never passes the last token with mass (both hold in floating point too:
    # 1 - u is exact and in (0, 1]). float64 keeps the accumulated rounding ~1e-12.
    cdf = flat.to(torch.float64).cumsum(-1)  # [R, V]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
    return torch.searchsorted(cdf, (1 - u) * cdf[:, -1:]).reshape(probs.shape[:-1])
