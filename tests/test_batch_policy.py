"""Draft lengths chosen for a whole batch: on hand-made cost curves, speculation fills spare
compute and shrinks as the batch fills; under any choice the batch stays lossless.

Properties: a flat verify curve (memory-bound: a pass costs the same at any rows) drafts
every member to its cap when drafts are accepted; a linear one (compute-bound: each row costs
a token's pass) drafts nothing; on a curve that is flat up to R rows then linear, the total
of the chosen draft tokens stays within the flat part and shrinks to 0 as the batch grows
past R; a costly draft round drafts less; a member that is rarely accepted gets less than one
that is; a new member is priced optimistically (it drafts where a prior-rate member would not),
and one at rest after bad evidence comes back to drafting as its evidence ages; draft calls or
target passes slower than calibrated, as served, reprice drafting (off), and calls back at the
calibrated price bring it back; a newcomer whose draft model has its prompt still to read
drafts only where the tokens it has left pay for that catch-up; the calibration pass leaves
the runtime's pool as it found it.
"""

from __future__ import annotations

import pytest
from conftest import tiny_model

from forerun.batch_engine import run_to_completion
from forerun.batch_policy import (
    ACCEPTANCE_PRIOR,
    BatchCost,
    BatchCostPolicy,
    measure_batch_curve,
)
from forerun.profile import ForwardCurve
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.torch_model import TorchRuntime

FLAT = ForwardCurve((1, 1000), (0.1, 0.1))
LINEAR = ForwardCurve((1, 1000), (0.1, 100.0))
KNEE = ForwardCurve((1, 16, 1000), (0.1, 0.1, 0.1 * 1000 / 16))  # flat to 16 rows, then linear


def test_a_flat_curve_drafts_everyone_to_the_cap_and_a_linear_one_nobody():
    assert BatchCost(FLAT).choose([0.8] * 4, [5, 3, 5, 0]) == [5, 3, 5, 0]
    assert BatchCost(LINEAR).choose([0.8] * 4, [5] * 4) == [0] * 4


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 12, 16, 24])
def test_speculation_shrinks_as_the_batch_fills(batch):
    ks = BatchCost(KNEE).choose([0.7] * batch, [8] * batch)
    assert batch + sum(ks) <= 16 or sum(ks) == 0
    if batch >= 16:
        assert sum(ks) == 0
    if batch <= 4:
        assert sum(ks) >= min(16 - batch, 8 * batch) - 2  # spare rows are used


def test_draft_cost_and_low_acceptance_draft_less():
    free = BatchCost(FLAT).choose([0.8, 0.8], [6, 6])
    costly = BatchCost(FLAT, draft_round=lambda m: 0.02 + 0.0 * m).choose([0.8, 0.8], [6, 6])
    assert sum(costly) < sum(free)
    ks = BatchCost(KNEE).choose([0.9, 0.2, 0.9], [8, 8, 8])
    assert ks[1] < ks[0] and ks[1] < ks[2]


def test_the_policy_learns_each_member_s_acceptance():
    policy = BatchCostPolicy(BatchCost(KNEE))
    for _ in range(20):
        policy.update(1, 4, 4)  # member 1: everything accepted
        policy.update(2, 4, 0)  # member 2: nothing
    ks = policy.choose([1, 2], [8, 8])
    assert ks[0] > ks[1]
    policy.forget(2)
    assert 2 not in policy.estimates


# one member: a 2-row pass costs 1.16x a 1-row one, a draft round 0.43x: drafting pays at an
# acceptance over ~0.59 only
PAIR = BatchCost(ForwardCurve((1, 2, 4), (0.186, 0.215, 0.250)),
                 ForwardCurve((1, 2), (0.080, 0.090)))


def test_a_new_member_is_priced_optimistically_and_a_resting_one_probes_again():
    assert PAIR.choose([ACCEPTANCE_PRIOR - 0.05], [4]) == [0]  # the bare prior would not draft
    policy = BatchCostPolicy(PAIR)
    assert policy.choose([1], [4])[0] > 0  # little evidence: optimistic, so it drafts and learns
    for _ in range(10):
        policy.update(1, 2, 0)  # rejected every time
    rests = 0
    while policy.choose([1], [4]) == [0]:
        rests += 1
        assert rests < 500
    assert rests > 10  # it rested, then probed again as its evidence aged
    for _ in range(10):
        policy.update(2, 4, 4)  # accepted every time: it keeps drafting
    assert policy.choose([2], [4])[0] >= 2


def test_draft_calls_slower_than_priced_turn_drafting_off_and_fast_ones_back_on():
    """The draft's calibration says drafting pays; served draft calls take 4x what it priced
    (catch-ups, a shared machine): the running ratio learns it and the policy stops drafting.
    Calls as fast as priced bring the ratio back, and drafting with it."""
    policy = BatchCostPolicy(PAIR)
    for _ in range(20):
        policy.update(1, 4, 4)  # always accepted: drafting pays at the calibrated price
    assert policy.choose([1], [4])[0] > 0
    for _ in range(12):
        policy.observe_drafting([4], 4 * PAIR.drafting([4]))
    assert policy.draft_scale > 3 and policy.choose([1], [4]) == [0]
    for _ in range(40):
        policy.observe_drafting([2], PAIR.drafting([2]))
    assert policy.draft_scale < 1.2 and policy.choose([1], [4])[0] > 0
    assert PAIR.drafting([3, 1, 0]) == pytest.approx(0.090 + 0.080 + 0.080)  # rounds of 2, 1, 1
    fed = BatchCostPolicy(PAIR)  # a call that also fed 100 catch-up rows, at its price
    fed.observe_drafting([4], PAIR.drafting([4]) + PAIR.draft_round(100), catch_up=100)
    assert fed.draft_scale == pytest.approx(1.0)


def test_a_newcomers_prompt_catch_up_is_priced_over_the_tokens_it_has_left():
    """A member whose draft model has yet to read its 300-token prompt: with 8 tokens left,
    that catch-up cannot pay back and the member does not draft; with 2,000 left it does,
    as a member with nothing to catch up does. Members with no backlog are priced as before."""
    policy = BatchCostPolicy(PAIR)
    for _ in range(20):
        policy.update(1, 4, 4)
    ready = policy.choose([1], [4], backlog=[0], remaining=[8])
    assert ready[0] > 0
    assert policy.choose([1], [4], backlog=[300], remaining=[8]) == [0]
    assert policy.choose([1], [4], backlog=[300], remaining=[2000])[0] > 0
    assert policy.catch_up(300, 8, 1.0, 4) > policy.catch_up(300, 2000, 1.0, 4) > 0
    assert policy.catch_up(0, 8, 1.0, 4) == 0.0


def test_target_passes_slower_than_calibrated_reprice_the_verify_curve():
    """A live verify curve: passes of 5 rows seen at 3x their calibration make a 4-token draft
    cost more than it gains, so the policy drafts less."""
    from forerun.profile import LiveCurve

    cheap = BatchCostPolicy(BatchCost(LiveCurve(ForwardCurve((1, 5), (0.1, 0.11)))))
    for _ in range(20):
        cheap.update(1, 4, 2)  # half of a draft accepted
    assert cheap.choose([1], [4]) == [4]
    cheap.observe_pass(1, 0.1)
    for _ in range(30):
        cheap.observe_pass(5, 0.33)
    assert cheap.choose([1], [4])[0] < 4


def test_batched_greedy_stays_lossless_under_the_batch_policy_and_drafts():
    from test_batch_engine import MIX, PROMPTS, _batch_runtime, _member, _solo, _tokens

    runtime = _batch_runtime()
    seqs = [_member(m, k, PROMPTS[p], n) for m, k, p, n in MIX]
    run_to_completion(runtime, seqs, lengths=BatchCostPolicy(BatchCost(KNEE)))
    for seq, (method, _k, p, n) in zip(seqs, MIX, strict=True):
        assert [t for s in seq.steps for t in s.tokens] == _solo(PROMPTS[p], n)
        if method != "none":
            assert sum(s.drafted for s in seq.steps) > 0, method
    assert _tokens(seqs[0])


def test_the_calibration_curve_is_monotone_and_leaves_the_pool_empty():
    runtime = BatchTorchRuntime(TorchRuntime(tiny_model(0), capacity=256), 1 << 21)
    curve = measure_batch_curve(runtime, 64, sizes=(1, 4, 16), members=4, context=20, reps=1)
    assert curve.sizes == (1, 4, 16)
    assert all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:], strict=False))
    assert runtime.pool.live == 0 and runtime.pool.free_slots == runtime.pool.slots
