"""Prompt lookup decoding (n-gram drafting): copy what followed the latest earlier occurrence of
the sequence's suffix. Free to run, deterministic (q = None), strong on edits and summaries.

Owns: the suffix matcher. Tries suffix lengths from `max_n` down to `min_n`, and for the longest
suffix that occurred before, proposes up to k tokens that followed its most recent occurrence.
Also `LookupBranch`: the same continuation as one more branch of a head's draft tree, with a
running acceptance estimate per matched run (how far back the text agrees with the earlier
occurrence) that prices its nodes.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from forerun.propose.base import AcceptanceEstimate, Draft, Needs

# LookupBranch's acceptance estimate per run class: the matched run r is the suffix length n
# (min_n..max_n), extended back while the text before the suffix agrees with the text before the
# earlier occurrence, in classes 1, .., max_n - 1, then max_n, 2 max_n, .. (RUN_CLASSES of them,
# the last open). Each class's chance that the next token follows the occurrence too has a
# prior worth PRIOR_TRIALS positions, LOOKUP_PRIOR_PER_N * r below max_n (low: evidence comes
# every step for free, while a draft on a cold guess costs a verify row), 1 - 1/r from max_n
# on, then evidence discounted by e^-1 per LOOKUP_MEMORY newer positions. Measured (greedy
# Qwen2.5-Coder-1.5B replies, 40 EditEval prompts, every step's continuation against the
# reply): the first token is taken 0.36 / 0.60 / 0.70 of the time after a run of 1 / 2 / 3,
# 0.82 after 4-7, 0.94 after 8-15, 0.97 after 16-31, 0.98 after more; a run's length tells a
# copy in progress from a chance match better than the suffix length alone.
LOOKUP_PRIOR_PER_N = 0.125
PRIOR_TRIALS = 2.0
LOOKUP_MEMORY = 16.0
RUN_CLASSES = 4
# A max_n-token suffix's continuation comes from whichever of its latest OCCURRENCES earlier
# occurrences has the longest run (ties: the latest), not from the latest alone: code repeats
# short patterns, and the occurrence being copied is the one the text agrees with furthest
# back. Replayed over recorded greedy outputs at k = 16 (the branch alone's decode speedup), 40
# EditEval replies: 1.67x latest only, 1.72x of 4 or 16; 8 others: 1.59x, 1.63x.
OCCURRENCES = 4


def run_prior(run: int, max_n: int) -> float:
    """A run class's prior chance that the next token follows the occurrence."""
    return LOOKUP_PRIOR_PER_N * run if run < max_n else 1 - 1 / run


def check_suffix_range(min_n: int, max_n: int) -> None:
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")


def find_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """[L] token ids -> up to k ids that followed the latest earlier match of the longest suffix."""
    return find_match(tokens, k, min_n, max_n)[0]


def find_match(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, int]:
    """find_continuation's ids and the length of the suffix they matched (0: none)."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        windows = sliding_window_view(tokens[:length - 1], n)  # [L-n, n]; excludes the suffix
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            begin = starts[-1] + n  # the latest occurrence is the most relevant one
            return tokens[begin:begin + k], n
    return tokens[:0], 0


class SuffixIndex:
    """find_match for a sequence that grows step by step, without rescanning it: the latest
    end of every n-gram (min_n <= n <= max_n) of the sequence but its last token (and for each
    max_n-gram's end, its occurrence before: `prev`), updated with the tokens each step adds.
    A step then costs O(max_n) lookups instead of find_match's scan of the whole sequence per
    suffix length (~0.3 ms a step at a few hundred tokens here, and growing with the
    context). A sequence that is not an extension of the last one is indexed anew. Answers
    equal find_match's (tests)."""

    def __init__(self, min_n: int, max_n: int):
        check_suffix_range(min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.reset()

    def reset(self) -> None:
        self.seen: list[int] = []  # the sequence indexed so far
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end, <= len(seen) - 2
        self.prev: dict[int, int] = {}  # a max_n-gram's end -> the end of its occurrence before

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k ids that followed the latest earlier occurrence of the longest suffix of
        `tokens` (min_n..max_n long), and that suffix's length (0: none)."""
        chain, n, _ = self.match_at(tokens, k)
        return chain, n

    def match_at(self, tokens: list[int], k: int) -> tuple[list[int], int, int]:
        """match's ids and suffix length, and where the occurrence ends (-1: none)."""
        self._extend(tokens)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k], n, end
        return [], 0, -1

    def longest_run(self, tokens: list[int], end: int, cap: int, tries: int) -> tuple[int, int]:
        """Of the latest `tries` occurrences of `tokens`' max_n-token suffix (the latest ending
        at `end`), the one that agrees with the text furthest back: (its end, that run, at
        most cap tokens); ties go to the latest."""
        best_end, best = end, self.max_n
        at = end
        for _ in range(tries):
            run, limit = self.max_n, min(cap, at + 1)
            while run < limit and tokens[-1 - run] == tokens[at - run]:
                run += 1
            if run > best:
                best_end, best = at, run
            at = self.prev.get(at, -1)
            if at < 0:
                break
        return best_end, best

    def _extend(self, tokens: list[int]) -> None:
        old = len(self.seen)
        if old > len(tokens) or tokens[:old] != self.seen:
            self.reset()
            old = 0
        # windows ending at old - 1 .. len(tokens) - 2 (the last token's come next step)
        for end in range(max(old - 1, 0), len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                gram = tuple(tokens[end - n + 1:end + 1])
                if n == self.max_n and gram in self.ends:
                    self.prev[end] = self.ends[gram]
                self.ends[gram] = end
        self.seen = list(tokens)


@dataclass
class NgramProposer:
    min_n: int = 1
    max_n: int = 4
    name: str = "ngram"
    runtime: ClassVar[None] = None  # no model: drafting costs no forward passes
    group: ClassVar[None] = None  # drafts alone
    needs: ClassVar[Needs] = Needs()  # the tokens alone

    def __post_init__(self):
        self._index = SuffixIndex(self.min_n, self.max_n)

    def prefill(self, prompt: list[int]) -> None:
        self._index.reset()

    def propose(self, tokens, k, sampling, generator) -> Draft:
        found, _ = self._index.match(tokens, k)
        return Draft(torch.tensor(found, dtype=torch.long))

    def commit(self, num_final: int) -> None:
        pass


@dataclass
class LookupBranch:
    """The prompt-lookup continuation as a branch of another drafter's tree (heads + lookup).

    Its nodes are priced like a head's, by path log-probabilities: the continuation's token
    at depth d follows a run of r + d - 1 if every token before it was taken (r: the run the
    suffix matched, from the occurrence that runs longest: OCCURRENCES), so it scores
    log a(r) + ... + log a(r + d - 1), with a(.) the running acceptance of the run's class.
    The estimates learn every step, drafted or not: the last continuation is compared with
    the tokens the target then produced (accepted ones and its own next token), each
    position up to the first difference one trial of its run's class.
    """

    min_n: int = 1
    max_n: int = 4
    stats: dict[int, AcceptanceEstimate] = field(default_factory=dict)  # per run class
    _last: tuple[int, list[int], int] | None = None  # (len(tokens), continuation, run)

    def __post_init__(self):
        self._index = SuffixIndex(self.min_n, self.max_n)
        self.reset()

    def reset(self) -> None:
        self._index.reset()
        self.stats = {n: AcceptanceEstimate(run_prior(n, self.max_n), PRIOR_TRIALS, LOOKUP_MEMORY)
                      for n in self._classes}
        self._last = None

    @cached_property
    def _classes(self) -> tuple[int, ...]:
        """The run classes' lower bounds: each suffix length below max_n, then max_n times 1,
        2, 4, ... (RUN_CLASSES of them)."""
        return (*range(self.min_n, self.max_n), *(self.max_n << i for i in range(RUN_CLASSES)))

    def run_class(self, run: int) -> int:
        """The class a matched run of this length falls in (its lower bound)."""
        return self._classes[bisect_right(self._classes, run) - 1]

    def acceptance(self, run: int) -> float:
        """The running per-token acceptance of continuations after a matched run this long."""
        return self.stats[self.run_class(run)].rate

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """Up to k ids to follow `tokens`, and each one's path log-probability of acceptance."""
        self._learn(tokens)
        chain, n, end = self._index.match_at(tokens, k)
        if not n or not chain:
            return [], []
        run = n  # how far the text agrees with the occurrence, back from the suffix
        if n == self.max_n:  # the occurrence (of the latest OCCURRENCES) with the longest run
            end, run = self._index.longest_run(tokens, end, self._classes[-1], OCCURRENCES)
            chain = tokens[end + 1:end + 1 + k]
        self._last = (len(tokens), chain, run)
        scores, score = [], 0.0
        for d in range(len(chain)):  # the d-th token follows a run d longer, if all accepted
            score += math.log(max(self.acceptance(run + d), 1e-9))
            scores.append(score)
        return chain, scores

    def _learn(self, tokens: list[int]) -> None:
        if self._last is None:
            return
        length, chain, run = self._last
        self._last = None
        truth = tokens[length:length + len(chain)]  # what the target chose after the chain's root
        matched = 0
        while matched < len(truth) and chain[matched] == truth[matched]:
            matched += 1
        for d in range(min(matched + 1, len(truth))):  # accepted ones, then the first miss
            self.stats[self.run_class(run + d)].observe(int(d < matched), 1)
