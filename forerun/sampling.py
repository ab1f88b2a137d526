"""Logits -> probabilities -> tokens. Pure functions; randomness comes in as a torch.Generator.

Owns: the sampling configuration and its validation, the temperature / top-k / top-p / min-p
transforms (one configuration, or one per row of a packed batch: `logits_to_probs_rows`, equal
bit for bit to `logits_to_probs` of each row), and drawing a token. Temperature 0 is greedy:
the distribution is one-hot on the argmax (first index on ties), so greedy decoding is the
T = 0 case of everything downstream, rejection sampling included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from forerun.grammar import Grammar
from forerun.processors import NONE, Processing


class SamplingError(ValueError):
    """An invalid sampling parameter."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    # penalties and logit bias: they read the history, so the batch step applies them to the
    # logits (`forerun.processors`) before the transforms here
    processing: Processing = NONE
    grammar: Grammar | None = None  # structured output: the batch step masks every row

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
    return probs / row_sums(probs)


def logits_to_probs_rows(logits: torch.Tensor, configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """[R, V] logits -> [R, V] probabilities, row r under configs[r]: the packed batch's
    sampled rows in one call, on the logits' device, the parameters as [R] tensors. Every row
    equals `logits_to_probs(logits[r], configs[r])` bit for bit (the same operations, each a
    row at a time inside: max, softmax, top-k, sort and cumsum never mix rows; tests check it),
    so a seeded sequence draws the same tokens whatever it is batched with. A filter runs only
    on the rows that ask for it (top-p's sort of the vocabulary is the costly one)."""
    R, V = logits.shape
    if len(configs) != R:
        raise SamplingError(f"{len(configs)} sampling configurations for {R} rows")
    if len(set(configs)) == 1:  # one configuration for every row: the per-row transform itself
        return logits_to_probs(logits, configs[0])
    device, tiny = logits.device, torch.finfo(logits.dtype).tiny
    greedy = torch.tensor([c.greedy for c in configs], device=device)  # [R]
    temperature = torch.tensor([[max(c.temperature, tiny)] for c in configs],
                               dtype=logits.dtype, device=device)  # [R, 1]
    top_k = torch.tensor([c.top_k if 0 < c.top_k < V and not c.greedy else 0 for c in configs],
                         device=device)  # [R]; 0 = off
    best = logits.argmax(-1, keepdim=True)  # [R, 1] a greedy row's token
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature  # [R, V]
    if bool((top_k > 0).any()):
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(
            -1, (top_k - 1).clamp_min(0)[:, None])  # [R, 1] each row's k-th largest
        cut_k = (logits < kth) & (top_k > 0)[:, None]  # [R, V]
        logits = logits.masked_fill(cut_k, -math.inf)
    probs = logits.softmax(-1)  # [R, V]
    nucleus = [r for r, c in enumerate(configs) if c.top_p < 1 and not c.greedy]
    if nucleus:
        top_p = torch.tensor([[configs[r].top_p] for r in nucleus], dtype=probs.dtype,
                             device=device)  # [N, 1]
        at = torch.tensor(nucleus, device=device)  # [N]
        sorted_p, order = probs[at].sort(-1, descending=True)  # [N, V]
        mass_before = sorted_p.cumsum(-1) - sorted_p  # [N, V] mass of strictly better tokens
        drop_sorted = mass_before >= top_p  # always keeps the top token
        probs = probs.index_copy(0, at, probs[at].masked_fill(
            drop_sorted.scatter(-1, order, drop_sorted), 0.0))
    if any(c.min_p > 0 for c in configs):
        min_p = torch.tensor([[c.min_p] for c in configs], dtype=probs.dtype,
                             device=device)  # [R, 1]; 0 drops nothing
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    probs = probs / row_sums(probs)
    one_hot = torch.zeros_like(probs).scatter_(-1, best, 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [..., 1]: each row's sum, rounded the same however many rows come along.
    A sum to one number over many elements is split across threads (a two-pass sum, rounded
    by the thread count), so a lone row is summed as one of two: a stride-0 copy of itself."""
    if x.numel() != x.shape[-1]:
        return x.sum(-1, keepdim=True)
    return x.reshape(1, -1).expand(2, -1).sum(-1, keepdim=True)[:1].reshape(*x.shape[:-1], 1)


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
