"""Continuous batching (`forerun.batch_session`) and the batch step's scheduling seams.

Properties (tiny float64 models, greedy): prompts fed in chunks under a pass token budget give
every member exactly its solo tokens, with no pass over the budget's rows beyond a whole-prompt
exception; a member whose drafter raises fails alone while the others finish with their solo
tokens; a dropped member's cache is free at once; a runtime with no pooled view batches through
forks (`ForkedBatch`) with the same outputs; only members that run the draft model pay its
rounds in the joint cost choice; `calibrate` measures the joint policy's pass costs before any
member arrives.
"""

from __future__ import annotations

import pytest
from conftest import tiny_model
from test_batch_engine import BUDGET, MIX, PROMPTS, _batch_runtime, _engine, _member, _solo, _tokens
from test_batch_policy import FLAT

from forerun.api import DEFAULT_KV_BUDGET_BYTES
from forerun.batch_engine import run_to_completion
from forerun.batch_policy import BatchCost
from forerun.batch_session import BatchSession
from forerun.propose import SpecConfig
from forerun.runtime.forked import ForkedBatch
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig

LONG = [(i * 7) % 50 + 1 for i in range(40)]  # a prompt several chunks long


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_chunked_prefill_keeps_every_output_and_the_pass_budget(method):
    engine = _engine(method, k=3)
    target = engine.batch_view("target", BUDGET)
    rows, forward = [], target.forward

    def counted(batch, *args, **kw):
        rows.append(len(batch.tokens))
        return forward(batch, *args, **kw)

    target.forward = counted
    prompts = [LONG, *PROMPTS[:3]]
    budgets = [20, 15, 25, 10]
    got = engine.generate_batch(prompts, max_tokens=budgets, kv_budget_bytes=BUDGET,
                                max_batch_tokens=8)
    for prompt, budget, out in zip(prompts, budgets, got, strict=True):
        assert out.token_ids == _solo(prompt, budget)
    # decode rows (at most 4 members x (k + 1)) plus a prompt share of 2, never a whole prompt
    assert max(rows) <= 4 * 4 + 2 and len(LONG) not in rows


class Broken:
    """A proposer that drafts like its inner one, then raises on its third draft."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, *args):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafter broke")
        return self.inner.propose(*args)


def test_a_failing_drafter_fails_its_member_alone():
    seqs = [_member(m, k, PROMPTS[p], n) for m, k, p, n in MIX]
    seqs[1].proposer = Broken(seqs[1].proposer)  # an n-gram member
    with pytest.raises(RuntimeError, match="drafter broke"):
        run_to_completion(_batch_runtime(), seqs)
    assert seqs[1].finish == "error" and str(seqs[1].error) == "drafter broke"
    for s, (_, _, p, n) in zip(seqs, MIX, strict=True):
        if s is not seqs[1]:
            assert s.error is None and _tokens(s) == _solo(PROMPTS[p], n)


def test_a_dropped_member_frees_its_cache_at_once():
    engine = _engine("draft", k=3)
    session = BatchSession(engine, BUDGET)
    pool = session.target.pool
    idle = pool.free_slots
    seqs = [session.sequence(p, SamplingConfig(), 30, engine.spec) for p in PROMPTS[:3]]
    for s in seqs:
        session.add(s)
    session.step()
    session.step()
    assert len(session.live) == 3 and pool.free_slots < idle
    session.drop(seqs[0])
    assert seqs[0].handle == -1 and pool.free_slots == idle - sum(s.slots() for s in seqs[1:])
    while not session.idle:
        session.step()
    assert pool.free_slots == idle
    for s, p in zip(seqs[1:], PROMPTS[1:3], strict=True):
        assert _tokens(s) == _solo(p, 30)


class Wrapped:
    """A one-sequence runtime that is not a TorchRuntime: it has no pooled batched view."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fork(self):
        return Wrapped(self.inner.fork())


def test_a_runtime_without_a_pooled_view_batches_through_forks():
    from test_engine import word_tokenizer

    from forerun import Engine

    engine = Engine.from_runtimes(Wrapped(TorchRuntime(tiny_model(0), capacity=256)),
                                  word_tokenizer(), None, SpecConfig("ngram", 3))
    budgets = [30, 12, 25, 20]
    got = engine.generate_batch(PROMPTS[:4], max_tokens=budgets, max_batch=3,
                                max_batch_tokens=6)
    assert isinstance(engine.batch_view("target", DEFAULT_KV_BUDGET_BYTES), ForkedBatch)
    for prompt, budget, out in zip(PROMPTS[:4], budgets, got, strict=True):
        assert out.token_ids == _solo(prompt, budget)


def test_only_members_running_the_draft_model_pay_its_rounds():
    cost = BatchCost(FLAT, draft_round=lambda m: 0.05)
    paying = cost.choose([0.8, 0.8], [6, 6])
    mixed = cost.choose([0.8, 0.8], [6, 6], paid=[True, False])
    assert mixed[1] == 6 and mixed[1] > paying[1]  # the free drafter drafts all it may
    assert cost.choose([0.8, 0.8], [6, 6], paid=[False, False]) == BatchCost(FLAT).choose(
        [0.8, 0.8], [6, 6])


def drain(session: BatchSession, seqs: list) -> tuple[list[list[int]], BatchSession]:
    """Add `seqs`, step the session until idle -> (each one's tokens, the session); none
    failed."""
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
    assert all(seq.error is None for seq in seqs), [seq.error for seq in seqs]
    return [[t for st in seq.steps for t in st.tokens] for seq in seqs], session


@pytest.mark.parametrize("method", ["none", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_regions_preempt_the_youngest_and_every_output_stays(method, temperature,
                                                                  monkeypatch):
    """Regions that start at the prompt and grow as members decode overcommit the pool: the
    youngest member is preempted (cache freed, recomputed when it comes back) and every member
    still gets exactly what it gets in a pool that holds everyone's worst case."""
    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    prompts, budgets = PROMPTS[:5], [40, 36, 44, 30, 40]
    samplings = [SamplingConfig(temperature=temperature, seed=i) for i in range(5)]
    engine = _engine(method, k=3)
    per_token = engine.batch_view("target", BUDGET).pool.bytes_per_token

    def run(budget_bytes: int, lazy: bool) -> tuple[list[list[int]], BatchSession]:
        session = BatchSession(engine, budget_bytes, lazy=lazy, max_batch_tokens=16)
        return drain(session, [session.sequence(p, s, n, SpecConfig(method, 3))
                               for p, s, n in zip(prompts, samplings, budgets, strict=True)])

    roomy, _ = run(BUDGET, lazy=False)
    tight, session = run(per_token * 150, lazy=True)  # ~2.5 members' worst case
    assert tight == roomy
    assert session.preempted > 0
    if temperature == 0:
        assert roomy == [_solo(p, n) for p, n in zip(prompts, budgets, strict=True)]


def test_the_shared_draft_pool_holds_the_target_pools_tokens_not_its_bytes():
    # a one-layer draft under a two-layer target: half the bytes a token, the same tokens
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.05, n_layers=1), capacity=256)
    engine = Engine.from_runtimes(target, word_tokenizer(), draft, SpecConfig("draft", 3))
    session = BatchSession(engine, BUDGET)
    seqs = [session.sequence(p, SamplingConfig(), 30, engine.spec) for p in PROMPTS[:3]]
    outputs, session = drain(session, seqs)
    pool = session._draft.runtime.pool
    assert pool.slots == session.target.pool.slots
    assert pool.slots * pool.bytes_per_token * 2 == BUDGET // session.target.pool.bytes_per_token \
        * session.target.pool.bytes_per_token
    assert outputs == [_solo(p, 30) for p in PROMPTS[:3]]
    lazy = BatchSession(engine, BUDGET // 2, lazy=True)  # (regions grow: the draft's do not)
    lazy.sequence(PROMPTS[0], SamplingConfig(), 30, engine.spec)
    assert lazy._draft.runtime.pool.slots == 2 * lazy.target.pool.slots


def test_calibrate_measures_the_joint_policys_pass_costs_before_any_member():
    """A server calibrates before its first request: the target's and the draft's batch curves
    are measured then, with no member yet, so no request's first pass stalls to time them."""
    from test_engine import word_tokenizer

    from forerun import Engine

    target = TorchRuntime(tiny_model(0), capacity=256)
    draft = TorchRuntime(tiny_model(0, noise=0.05, n_layers=1), capacity=256)
    engine = Engine.from_runtimes(target, word_tokenizer(), draft, SpecConfig("draft", 3))
    session = BatchSession(engine, BUDGET, joint=True)
    session.calibrate()
    assert set(engine._batch_curves) == {"target", "draft"}
    assert session._lengths is not None and session._lengths.cost.draft_round is not None
