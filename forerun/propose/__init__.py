"""Drafting methods, each one module behind the Proposer protocol, registered in PROPOSERS.

A factory takes the speculation config and the models it may use and returns a Proposer; the
engine looks methods up here and never branches on their names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from forerun.propose.base import Draft, Proposer
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.ngram import NgramProposer
from forerun.runtime.base import Runtime


@dataclass(frozen=True)
class SpecConfig:
    method: str = "draft"  # "none" (plain decoding) or a key of PROPOSERS
    k: int = 4  # draft tokens per step (the start value for adaptive, the cap for cost)
    policy: str = "fixed"  # a key of forerun.policy.POLICIES
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self):
        if self.method != "none" and self.method not in PROPOSERS:
            raise ValueError(f"unknown method {self.method!r}; choose none, {', '.join(PROPOSERS)}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")


def _draft(spec: SpecConfig, target: Runtime, draft: Runtime | None) -> Proposer:
    if draft is None:
        raise ValueError("method 'draft' needs a draft model (--draft)")
    return DraftModelProposer(draft, target.config.vocab_size)


def _ngram(spec: SpecConfig, target: Runtime, draft: Runtime | None) -> Proposer:
    return NgramProposer(spec.ngram_min, spec.ngram_max)


PROPOSERS: dict[str, Callable[[SpecConfig, Runtime, Runtime | None], Proposer]] = {
    "draft": _draft,
    "ngram": _ngram,
}

__all__ = ["PROPOSERS", "Draft", "Proposer", "SpecConfig"]
