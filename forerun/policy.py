"""Draft length policies: how many tokens to propose next, learned from how many were accepted.

Owns: the LengthPolicy protocol, a fixed k, and an adaptive k (the +2 / -1 heuristic used by
Hugging Face assisted generation: grow by 2 after a fully accepted draft, shrink by 1 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class LengthPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, drafted: int, accepted: int) -> None: ...


@dataclass
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class AdaptiveK:
    k: int
    k_min: int = 1
    k_max: int = 16
    grow: int = 2
    shrink: int = 1

    def next_k(self) -> int:
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # nothing was proposed (e.g. no n-gram match): no evidence
            return
        step = self.grow if accepted == drafted else -self.shrink
        self.k = max(self.k_min, min(self.k_max, self.k + step))


POLICIES = {"fixed": FixedK, "adaptive": AdaptiveK}
