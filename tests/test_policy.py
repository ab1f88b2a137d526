"""Length policies and the forward-time curves the cost policy reads.

The cost policy is tested on synthetic curves (exact, no timing): it turns speculation off where
a verify step costs as much per token as plain decoding, drafts its cap where verification is
flat and drafting free, probes while off and switches back on; every k it picks is lossless.
Measurement is tested against a fake clock (exact) and once on a real tiny runtime (by the
passes it ran, never by their times)."""

import math

import pytest
import torch
from conftest import heads_for, tiny_config, tiny_runtime

import forerun.profile as profile
from forerun.engine import speculative_decode
from forerun.policy import (
    MAX_PROBE_EVERY,
    POLICIES,
    PROBE_EVERY,
    PROBE_K,
    CostModelK,
    expected_tokens,
)
from forerun.profile import (
    LIVE_CLIP,
    ForwardCurve,
    LiveCurve,
    cached_curve,
    calibrated_curve,
    calibration_sizes,
    measure_forward_curve,
)
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.reference import plain_decode
from forerun.runtime.base import Capabilities, ForwardOutput
from forerun.sampling import SamplingConfig, make_generator

K_MAX = 6


def linear_curve(per_token: float, first: float = 1.0, largest: int = K_MAX + 1) -> ForwardCurve:
    """verify(n) = first + per_token * (n - 1), measured at 1..largest."""
    sizes = tuple(range(1, largest + 1))
    return ForwardCurve(sizes, tuple(first + per_token * (n - 1) for n in sizes))


STEEP = linear_curve(1.0)  # verify(2) / verify(1) = 2: verifying costs as much as decoding
FLAT = linear_curve(0.0)  # a verify step costs one plain step, whatever its length
MODERATE = linear_curve(0.1)


def feed(policy: CostModelK, drafted: int, accepted: int, times: int) -> None:
    for _ in range(times):
        policy.update(drafted, accepted)


# --- ForwardCurve ----------------------------------------------------------------------------

def test_forward_curve_interpolates_clamps_and_extrapolates():
    curve = ForwardCurve((1, 2, 4), (1.0, 2.0, 3.0))
    assert curve(1) == 1.0 and curve(2) == 2.0 and curve(4) == 3.0  # measured points
    assert curve(3) == 2.5  # linear between 2 and 4
    assert curve(0) == 1.0  # clamped below the first size
    assert curve(6) == 4.0  # the last segment's slope (0.5 per token) carried on
    assert ForwardCurve((1, 2), (2.0, 1.0))(5) == 1.0  # a noisy falling tail is held flat
    assert ForwardCurve((1,), (0.5,))(8) == 0.5
    assert curve.to_dict() == {"sizes": [1, 2, 4], "seconds": [1.0, 2.0, 3.0]}


def test_forward_curve_rejects_bad_points():
    with pytest.raises(ValueError, match="one time per size"):
        ForwardCurve((1, 2), (1.0,))
    with pytest.raises(ValueError, match="strictly increasing"):
        ForwardCurve((2, 1), (1.0, 1.0))


# --- LiveCurve: the calibration corrected by the passes seen since ----------------------------

def test_live_curve_is_its_calibration_until_it_sees_a_pass():
    base = ForwardCurve((1, 2, 4), (1.0, 2.0, 3.0))
    live = LiveCurve(base)
    assert [live(n) for n in (1, 2, 3, 4, 6)] == [base(n) for n in (1, 2, 3, 4, 6)]
    assert live.sizes == base.sizes and live.to_dict() == {**base.to_dict(), "seen": {}}


def test_one_size_seen_scales_the_whole_curve_keeping_its_shape():
    live = LiveCurve(ForwardCurve((1, 2, 4), (1.0, 2.0, 3.0)))
    live.observe(1, 0.5)
    assert live(1) == 0.5 and live(2) == 1.0 and live(4) == 1.5  # verify(2)/verify(1) stays 2


def test_sizes_seen_correct_the_shape_and_between_them_it_interpolates():
    """A curve calibrated on a busy machine (its one-token pass slowed most) makes a 2-token
    verify look nearly free; the passes seen afterwards restore the real step."""
    live = LiveCurve(ForwardCurve((1, 2, 3, 5), (1.4, 1.45, 1.5, 2.0)))
    for _ in range(10):
        live.observe(1, 1.0)
        live.observe(5, 2.0)
    assert live(1) == pytest.approx(1.0) and live(5) == pytest.approx(2.0)
    ratio_1, ratio_5 = 1.0 / 1.4, 1.0
    assert live.ratio(3) == pytest.approx(ratio_1 + (ratio_5 - ratio_1) / 2)
    assert live(8) == pytest.approx(live.base(8))  # past the largest seen: its ratio
    assert live(2) / live(1) > live.base(2) / live.base(1)  # drafting no longer looks free


def test_live_ratio_is_a_mean_then_a_running_average_and_a_stall_moves_it_little():
    live = LiveCurve(ForwardCurve((1,), (1.0,)))
    live.observe(1, 0.8)
    live.observe(1, 0.6)
    assert live(1) == pytest.approx(0.7)  # the mean of its first passes
    live.observe(1, 100.0)  # one pass stalled by the machine
    assert live(1) <= 0.7 * LIVE_CLIP
    live.observe(0, 1.0)  # nothing to learn from
    live.observe(1, 0.0)
    assert live.to_dict()["seen"] == {1: [round(live.ratio(1), 4), 3]}


def test_the_decode_loop_shows_its_verify_passes_to_the_target_s_curve():
    target = tiny_runtime(0)
    curve = calibrated_curve(target, 5)
    assert isinstance(curve, LiveCurve) and cached_curve(target) is curve
    proposer = PROPOSERS["ngram"](SpecConfig("ngram", 4), ProposerContext(target))
    steps = list(speculative_decode(target, proposer, CostModelK(4, MODERATE), [1, 2, 3] * 4,
                                    SamplingConfig(), 20, (), make_generator(0)))
    seen = curve.to_dict()["seen"]
    assert sum(count for _, count in seen.values()) == len(steps) - 1  # every verify pass
    assert all(ratio > 0 for ratio, _ in seen.values())


# --- the cost policy -----------------------------------------------------------------------

def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1  # only the recovered token
    assert expected_tokens(1.0, 5) == 6  # every draft token plus the bonus
    assert expected_tokens(0.5, 2) == 1.75


def test_steep_curve_and_low_acceptance_decode_plainly():
    policy = CostModelK(K_MAX, STEEP)
    feed(policy, 4, 0, 10)
    assert policy.acceptance < 0.15
    assert policy.best_k() == 0 and policy.next_k() == 0


def test_flat_curve_high_acceptance_and_free_drafter_draft_the_cap():
    policy = CostModelK(K_MAX, FLAT, draft_seconds=0.0)
    feed(policy, 4, 4, 10)
    assert policy.acceptance > 0.9
    assert policy.next_k() == K_MAX


def test_a_costly_drafter_turns_speculation_off():
    free, costly = CostModelK(K_MAX, FLAT), CostModelK(K_MAX, FLAT, draft_seconds=1.0)
    for policy in (free, costly):
        feed(policy, 4, 2, 10)
    assert free.best_k() > 0 and costly.best_k() == 0


def test_evidence_counts_tested_positions_only():
    policy = CostModelK(K_MAX, FLAT)
    policy.update(4, 1)  # position 0 accepted, 1 rejected, 2 and 3 never tested
    assert (policy.accepted, policy.trials) == (1, 2)
    policy = CostModelK(K_MAX, FLAT)
    policy.update(3, 3)
    assert (policy.accepted, policy.trials) == (3, 3)
    policy.update(0, 0)  # nothing drafted: nothing learned
    assert (policy.accepted, policy.trials) == (3, 3)


def test_probes_while_off_and_switches_back_on_when_acceptance_turns_high():
    policy = CostModelK(K_MAX, MODERATE, draft_seconds=0.05)
    feed(policy, 4, 0, 10)
    assert policy.best_k() == 0
    ks = []
    for _ in range(4 * PROBE_EVERY):  # from here on every drafted token is accepted
        k = policy.next_k()
        ks.append(k)
        policy.update(k, k)
    first_probe = next(i for i, k in enumerate(ks) if k > 0)
    assert first_probe < PROBE_EVERY and ks[first_probe] == PROBE_K
    assert ks[-1] == K_MAX  # back on, at the cap


def test_probing_backs_off_where_speculation_never_pays():
    policy = CostModelK(K_MAX, MODERATE, draft_seconds=0.05)
    probes = []
    for step in range(8 * MAX_PROBE_EVERY):
        k = policy.next_k()
        if k:
            probes.append(step)
        policy.update(k, 0)  # every draft rejected at once
    late = [s for s in probes if s >= 4 * MAX_PROBE_EVERY]
    assert len(probes) >= 4  # it keeps probing, but over the last 4 * MAX_PROBE_EVERY steps
    assert len(late) <= 4  # at most once per MAX_PROBE_EVERY


def test_every_k_it_picks_is_lossless():
    """Greedy speculative == plain under the cost policy, on a curve that makes it draft."""
    prompt, max_new = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], 40
    steps = plain_decode(tiny_runtime(0), prompt, SamplingConfig(), max_new, (), make_generator(0))
    expected = [t for s in steps for t in s.tokens]
    for method in PROPOSERS:
        target = tiny_runtime(0)
        proposer = PROPOSERS[method](SpecConfig(method, 4), ProposerContext(
            target, tiny_runtime(0, noise=0.05), heads_for(method, target)))
        steps = list(speculative_decode(target, proposer, CostModelK(4, MODERATE, 0.05), prompt,
                                        SamplingConfig(), max_new, (), make_generator(0)))
        assert [t for s in steps for t in s.tokens] == expected
        assert sum(s.drafted for s in steps) > 0


# --- measurement -----------------------------------------------------------------------------

class ClockRuntime:
    """A fake runtime whose forward over T tokens advances a fake clock by BASE + PER_TOKEN * T."""

    BASE, PER_TOKEN = 1.0, 0.25
    capabilities, curve = Capabilities(), None

    def __init__(self, capacity: int = 256):
        self.config, self.capacity, self.length = tiny_config(), capacity, 0
        self.now, self.forwards = 0.0, []  # (cache length before, tokens)
        self.delay = lambda: 0.0  # extra seconds a pass takes (a busy machine)

    def clock(self) -> float:
        return self.now

    def forward(self, tokens, **kwargs) -> ForwardOutput:
        assert tokens.max() < self.config.vocab_size
        self.forwards.append((self.length, tokens.shape[0]))
        self.length += tokens.shape[0]
        self.now += self.BASE + self.PER_TOKEN * tokens.shape[0] + self.delay()
        return ForwardOutput(torch.zeros(tokens.shape[0], self.config.vocab_size))

    def truncate(self, length: int) -> None:
        self.length = length


@pytest.fixture
def clock_runtime(monkeypatch):
    rt = ClockRuntime()
    monkeypatch.setattr(profile, "perf_counter", rt.clock)
    return rt


def test_measure_forward_curve_times_each_size_after_the_context(clock_runtime):
    rt = clock_runtime
    curve = measure_forward_curve(rt, sizes=(4, 1, 2), context=30, reps=3, warmup=1)
    assert curve.sizes == (1, 2, 4)
    assert curve.seconds == tuple(rt.BASE + rt.PER_TOKEN * n for n in (1, 2, 4))
    assert rt.forwards[0] == (0, 30)  # the context, then every pass right after it
    # rounds over all sizes (a slow spell touches every size), a warm-up round first
    assert rt.forwards[1:] == [(30, n) for _ in range(1 + 3) for n in (1, 2, 4)]
    assert rt.length == 0


def test_calibration_keeps_each_size_s_fastest_pass(clock_runtime):
    """One slow one-token pass (the machine busy) must not make longer verifies look cheap."""
    rt = clock_runtime
    # the context, the warm-up round (1, 2), then three of five timed one-token passes slow
    slow = iter([0.0, 0.0, 0.0, 5.0, 0.0, 5.0, 0.0, 5.0, 0.0])
    base = rt.BASE
    rt.delay = lambda: next(slow, 0.0)
    curve = calibrated_curve(rt, 2)
    assert curve.seconds == pytest.approx((base + rt.PER_TOKEN, base + 2 * rt.PER_TOKEN))


def test_measure_forward_curve_fits_the_context_into_the_cache(clock_runtime):
    rt = clock_runtime
    rt.capacity = 20
    measure_forward_curve(rt, sizes=(1, 8), context=200, reps=1)
    assert rt.forwards[0] == (0, 12) and rt.length == 0
    with pytest.raises(ValueError, match="capacity"):
        measure_forward_curve(rt, sizes=(1, 32))


def test_calibration_sizes_are_dense_for_short_drafts():
    assert calibration_sizes(1) == (1,)
    assert calibration_sizes(5) == (1, 2, 3, 4, 5)
    assert calibration_sizes(17) == (1, 2, 3, 4, 8, 16, 17)


def test_calibrated_curve_is_measured_once_per_runtime(clock_runtime):
    rt = clock_runtime
    curve = calibrated_curve(rt, 5)
    assert curve.sizes == (1, 2, 3, 4, 5)
    measured = len(rt.forwards)
    assert calibrated_curve(rt, 3) is curve and len(rt.forwards) == measured
    assert calibrated_curve(rt, 9).sizes[-1] == 9  # a longer draft needs a longer curve
    assert len(rt.forwards) > measured


def test_measure_forward_curve_on_a_tiny_runtime(monkeypatch):
    """On a real runtime, checked by what it ran, not by how long that took (timings on a
    shared machine say nothing reliable): the context once, then rounds of every size right
    after it, each pass's logits for every token, a time per size, the cache empty after."""
    rt = tiny_runtime(0)
    passes, forward = [], rt.forward

    def recorded(tokens, **kwargs):
        out = forward(tokens, **kwargs)
        passes.append((rt.length - tokens.shape[0], tokens.shape[0], out.logits.shape[0]))
        return out

    monkeypatch.setattr(rt, "forward", recorded)
    curve = measure_forward_curve(rt, sizes=(1, 2, 4, 8), context=50, reps=3, warmup=1)
    assert curve.sizes == (1, 2, 4, 8) and len(curve.seconds) == 4
    assert passes[0][:2] == (0, 50)
    assert passes[1:] == [(50, n, n) for _ in range(1 + 3) for n in (1, 2, 4, 8)]
    assert all(math.isfinite(s) and s > 0 for s in curve.seconds)
    assert rt.length == 0


def test_cost_factory_prices_the_drafter():
    target, draft = tiny_runtime(0), tiny_runtime(1)
    spec = SpecConfig("draft", 3, "cost")
    free = POLICIES["cost"](spec, target, None)
    priced = POLICIES["cost"](spec, target, draft)
    assert free.k_max == 3 and free.verify.sizes[-1] == 4
    assert free.draft_seconds == 0 and priced.draft_seconds > 0
    assert target.length == draft.length == 0
