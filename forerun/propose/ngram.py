"""Prompt lookup decoding (n-gram drafting): copy what followed the latest earlier occurrence of
the sequence's suffix. Free to run, deterministic (q = None), strong on edits and summaries.

Owns: the suffix matcher. Tries suffix lengths from `max_n` down to `min_n`, and for the longest
suffix that occurred before, proposes up to k tokens that followed its most recent occurrence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from forerun.propose.base import Draft


def find_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """[L] token ids -> up to k ids that followed the latest earlier match of the longest suffix."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)  # [L-n, n]; excludes the suffix
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            begin = starts[-1] + n  # the latest occurrence is the most relevant one
            return tokens[begin:begin + k]
    return tokens[:0]


@dataclass
class NgramProposer:
    min_n: int = 1
    max_n: int = 4
    name: str = "ngram"
    runtime: ClassVar[None] = None  # no model: drafting costs no forward passes

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= ngram min ({self.min_n}) <= ngram max ({self.max_n})")

    def prefill(self, prompt: list[int]) -> None:
        pass

    def propose(self, tokens, k, sampling, generator) -> Draft:
        found = find_continuation(np.asarray(tokens, dtype=np.int64), k, self.min_n, self.max_n)
        return Draft(torch.from_numpy(found.copy()))

    def commit(self, num_final: int) -> None:
        pass
