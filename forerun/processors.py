"""Logits processors that read the history: repetition, presence and frequency penalties and
logit bias, applied to the target's logits at every verified position.

Owns: `Processing` (the options, frozen; part of a `SamplingConfig`), `process_row` (one row's
logits under one history) and `process_rows` (every processed row of a pass). A speculative
pass verifies K drafted tokens at once, and position i of a draft must be processed as if
tokens < i had been generated: row i's history is the committed sequence plus the draft's
tokens on the path to it (a tree's ancestors). Rejection sampling against the processed p is
then exact: the output distribution is plain sampling from the processed target, for every
method, because each verified row's p is the one plain decoding would compute at that point.

Definitions (vLLM's, which OpenAI clients expect):
- repetition_penalty r (CTRL, Keskar et al. 2019; 1 = off): for every token seen in the prompt
  or the output, a logit l becomes l / r if l > 0, else l * r;
- frequency_penalty f and presence_penalty e (OpenAI; 0 = off): a token generated c times so
  far (output only, not the prompt) loses f * c + e * (c > 0);
- logit_bias (OpenAI): a fixed amount added to a token's logit, in [-100, 100].
Applied in that order, before temperature, top-k, top-p and min-p. Every operation is per row
and elementwise, so a row's bits do not depend on what it is batched with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value
PENALTY_BOUND = 2.0  # OpenAI's bound on presence / frequency penalties


class ProcessingError(ValueError):
    """An invalid processing option."""


@dataclass(frozen=True)
class Processing:
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs, tokens ascending

    def __post_init__(self):
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ProcessingError("repetition_penalty must be a finite number > 0, got "
                                  f"{self.repetition_penalty}")
        for name, value in (("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            if not (math.isfinite(value) and -PENALTY_BOUND <= value <= PENALTY_BOUND):
                raise ProcessingError(f"{name} must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0):
                raise ProcessingError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise ProcessingError(f"logit_bias values must be in [-100, 100], got {bias}")

    @staticmethod
    def of(repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None
           ) -> Processing:
        """From loose options (a dict of biases, any order)."""
        return Processing(float(repetition_penalty), float(presence_penalty),
                          float(frequency_penalty),
                          tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items())))

    @property
    def active(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def check_vocab(self, vocab_size: int) -> None:
        """Every biased token must exist in the model's vocabulary."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise ProcessingError(f"logit_bias token {token} is outside the vocabulary "
                                      f"(size {vocab_size})")


NONE = Processing()


def process_row(logits: torch.Tensor, cfg: Processing, history: Sequence[int],
                output_from: int) -> torch.Tensor:
    """[V] logits -> [V] processed, for a position whose preceding tokens are `history`, of
    which `history[output_from:]` were generated (the penalties' output tokens)."""
    if not cfg.active:
        return logits
    logits = logits.clone()
    if cfg.repetition_penalty != 1.0 and len(history):
        seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)  # [S]
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / cfg.repetition_penalty, x * cfg.repetition_penalty)
    generated = history[output_from:]
    if (cfg.presence_penalty or cfg.frequency_penalty) and len(generated):
        ids, counts = torch.tensor(list(generated), dtype=torch.long,
                                   device=logits.device).unique(return_counts=True)  # [U], [U]
        counts = counts.to(logits.dtype)
        logits[ids] -= cfg.frequency_penalty * counts + cfg.presence_penalty
    if cfg.logit_bias:
        ids = torch.tensor([t for t, _ in cfg.logit_bias], dtype=torch.long, device=logits.device)
        logits[ids] += torch.tensor([b for _, b in cfg.logit_bias], dtype=logits.dtype,
                                    device=logits.device)
    return logits


def process_rows(logits: torch.Tensor, configs: Sequence[Processing],
                 histories: Sequence[Sequence[int]], output_from: Sequence[int]
                 ) -> torch.Tensor:
    """[R, V] logits -> [R, V]: row r through `process_row(logits[r], configs[r],
    histories[r], output_from[r])`; rows without processing are left as they are (no copy
    when none has any)."""
    if not any(c.active for c in configs):
        return logits
    out = logits.clone()
    for r, (cfg, history, start) in enumerate(zip(configs, histories, output_from, strict=True)):
        if cfg.active:
            out[r] = process_row(logits[r], cfg, history, start)
    return out
