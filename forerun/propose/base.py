"""The Proposer protocol and the Draft it returns.

Owns: the seam every drafting method plugs into. A proposer sees the whole token sequence so far
(prompt + output), proposes up to k next tokens, and is told after verification how much of the
sequence is final so it can roll back any state (a KV cache) built on rejected tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [K] int64; K may be 0 (nothing to propose: a plain decoding step)
    q: torch.Tensor | None = None  # [K, V] draft probabilities; None = deterministic drafter
    parents: torch.Tensor | None = None  # [K] parent index per node (-1 = root) for trees

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.empty(0, dtype=torch.long))


class Proposer(Protocol):
    name: str
    runtime: Runtime | None  # the model it runs once per drafted token; None = free to draft

    def prefill(self, prompt: list[int]) -> None:
        """Start a new sequence with this prompt."""
        ...

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        """Up to k tokens to follow `tokens`; sampled from q when q is returned."""
        ...

    def commit(self, num_final: int) -> None:
        """The first `num_final` tokens of the sequence are final; forget anything after them."""
        ...
