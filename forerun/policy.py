"""Draft length policies: how many tokens to propose next, learned from how many were accepted.

Owns: the LengthPolicy protocol, its implementations and the POLICIES registry:
- fixed: always k;
- adaptive: the +2 / -1 heuristic of Hugging Face assisted generation (grow by 2 after a fully
  accepted draft, shrink by 1 otherwise);
- cost: the k in [0, k_max] with the most expected tokens per second under measured forward
  times, where k = 0 is a plain decoding step, so speculation switches itself off where it does
  not pay. Its costs come from `forerun.profile`, measured once per runtime at first use.

A factory in POLICIES takes (spec, target, drafter): the speculation config, the target runtime
and the runtime the proposer runs per drafted token (None for a free drafter such as n-gram).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

from forerun.profile import ForwardCurve, calibrated_curve
from forerun.propose import SpecConfig
from forerun.propose.base import AcceptanceEstimate
from forerun.runtime.base import Runtime

# The cost policy's acceptance estimate: a prior worth PRIOR_TRIALS draft positions, then
# evidence discounted by e^-1 per ACCEPTANCE_MEMORY newer positions (it follows the text).
ACCEPTANCE_PRIOR = 0.5
PRIOR_TRIALS = 2.0
ACCEPTANCE_MEMORY = 16.0
# At k = 0 it learns nothing, so every PROBE_EVERY-th step it drafts PROBE_K tokens once. A probe
# with a rejection doubles the interval (up to MAX_PROBE_EVERY, so probing where speculation
# never pays costs under a percent of steps); a fully accepted probe resets it.
PROBE_K = 2
PROBE_EVERY = 8
MAX_PROBE_EVERY = 128


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


def expected_tokens(acceptance: float, k: int) -> float:
    """E[tokens emitted by a step drafting k], each draft token accepted with probability a
    independently until the first rejection, plus the recovered or bonus token:
    1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    return sum(acceptance ** i for i in range(k + 1))


@dataclass
class CostModelK:
    """Drafts the k in [0, k_max] maximising E[tokens | k] / (verify(k + 1) + k * draft_seconds)
    under a running per-token acceptance estimate; k = 0 is plain decoding, with probes."""

    k_max: int
    verify: ForwardCurve  # target seconds per forward over n tokens: a step verifies k + 1
    draft_seconds: float = 0.0  # per drafted token; 0 for a free drafter (n-gram)
    estimate: AcceptanceEstimate = field(init=False)
    _plain_steps: int = field(default=0, init=False)
    _probe_every: int = field(default=PROBE_EVERY, init=False)
    _probing: bool = field(default=False, init=False)

    def __post_init__(self):
        self.estimate = AcceptanceEstimate(ACCEPTANCE_PRIOR, PRIOR_TRIALS, ACCEPTANCE_MEMORY)
        seconds = [self.verify(k + 1) + k * self.draft_seconds for k in range(self.k_max + 1)]
        # timing noise must not make a longer draft look cheaper than a shorter one
        self._step_seconds = list(accumulate(seconds, max))  # [k_max + 1]

    @property
    def acceptance(self) -> float:
        return self.estimate.rate

    @property
    def accepted(self) -> float:  # discounted accepted draft positions
        return self.estimate.accepted

    @property
    def trials(self) -> float:  # discounted observed draft positions
        return self.estimate.trials

    def best_k(self) -> int:
        """The k with the most expected tokens per second; ties go to the shorter draft."""
        a = self.acceptance
        rate = [expected_tokens(a, k) / s for k, s in enumerate(self._step_seconds)]
        return max(range(len(rate)), key=rate.__getitem__)

    def next_k(self) -> int:
        k = self.best_k()
        self._plain_steps = self._plain_steps + 1 if k == 0 else 0
        self._probing = k == 0 and self._plain_steps >= self._probe_every
        if self._probing:
            self._plain_steps = 0
            return min(PROBE_K, self.k_max)
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if self._probing and drafted:  # a rejected probe backs off, a fully accepted one resets
            grown = min(2 * self._probe_every, MAX_PROBE_EVERY)
            self._probe_every = grown if accepted < drafted else PROBE_EVERY
        self._probing = False
        self.estimate.observe(accepted, drafted)


PolicyFactory = Callable[[SpecConfig, Runtime, Runtime | None], LengthPolicy]


def _fixed(spec: SpecConfig, target: Runtime, drafter: Runtime | None) -> LengthPolicy:
    return FixedK(spec.k)


def _adaptive(spec: SpecConfig, target: Runtime, drafter: Runtime | None) -> LengthPolicy:
    return AdaptiveK(spec.k)


def _cost(spec: SpecConfig, target: Runtime, drafter: Runtime | None) -> LengthPolicy:
    """spec.k is the cap. Measures the runtimes at their first use (empties their caches)."""
    draft_seconds = calibrated_curve(drafter, 1)(1) if drafter is not None else 0.0
    return CostModelK(spec.k, calibrated_curve(target, spec.k + 1), draft_seconds)


POLICIES: dict[str, PolicyFactory] = {"fixed": _fixed, "adaptive": _adaptive, "cost": _cost}
