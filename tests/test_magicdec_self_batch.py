"""The magicdec method in a batch with `self` as its drafter: MagicDec's self-speculation, the
target drafting for itself through a sparse view of its own cache pool (`SelfDraft`).

Properties (tiny float64 models): greedy `self` members equal their solo plain output for
k = 1, 3, 5 in a batch that mixes them with plain and draft-model members, admitted while
others decode, on contexts several windows long; sampled members have the target's exact
joint (chi-square, exact enumeration); no member builds a cache of its own nor prefills a
draft (no StreamingRuntime, one pool region a member, as plain's, and the drafter's passes
carry the draft rows only: one row a member, at its positions L.. L+k-1); after every verify
the target's cache holds what a plain batch's holds (the draft's rows overwritten), to float64
rounding; each draft row attends to the sinks and its window only, flat as the context grows;
a member preempted mid-run keeps its output; a batch without the torch target pool (or a
sequence alone) drafts as before, over a sparse cache of its own.

Statistical checks: 1 (the exact joint, test_magicdec_batch's `sampled_joint`) at ALPHA = 1e-4:
the file fails by chance with probability below 1e-4 (seeds pinned).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from test_batch_engine import _solo
from test_engine import word_tokenizer
from test_magicdec import LONG_PROMPT, SINKS, WINDOW
from test_magicdec_batch import K, V, sampled_joint

from forerun import Engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.batch_session import BatchSession
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import BATCH_TARGET
from forerun.propose.draft_batch import SHARED_DRAFT
from forerun.propose.magicdec import SELF_MAGICDEC, MagicDecProposer, SelfDraft, SelfMember
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.streaming import StreamingRuntime
from forerun.sampling import SamplingConfig, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = 1 << 20  # bytes: ~1,000 tokens of the tiny model
GREEDY = SamplingConfig()
PROMPTS = [LONG_PROMPT, LONG_PROMPT[:45], LONG_PROMPT[5:], LONG_PROMPT[:30], LONG_PROMPT[9:]]
NEW = [30, 20, 25, 15, 28]


def self_spec(k: int = 3, sinks: int = SINKS, window: int = WINDOW) -> SpecConfig:
    return SpecConfig("magicdec", k, magicdec_sinks=sinks, magicdec_window=window,
                      magicdec_drafter="self")


def engine() -> Engine:
    return Engine.from_runtimes(tiny_runtime(0), word_tokenizer(), tiny_runtime(0, noise=0.05),
                                self_spec())


def tokens_of(seq: Sequence) -> list[int]:
    return [t for st in seq.steps for t in st.tokens]


class Passes:
    """The view's passes, recorded: per pass, per member (handle, first position, rows, keys
    read, the mask's attended pairs per row)."""

    def __init__(self, group: SelfDraft):
        self.view, self.passes = group.runtime, []
        self.rounds: list[dict[int, tuple[int, int]]] = []  # per propose: handle -> (L, k)
        forward, propose = self.view.forward, group.propose

        def recorded_forward(batch, *args, **kw):
            starts = [self.view.length(s) for s in batch.seqs]
            out = forward(batch, *args, **kw)
            self.passes.append([(s, start, batch.cu[b + 1] - batch.cu[b],
                                 list(self.view.last_keys[b]),
                                 self.view.last_masks[b].sum(-1).tolist())
                                for b, (s, start) in enumerate(zip(batch.seqs, starts,
                                                                   strict=True))])
            return out

        def recorded_propose(requests):
            self.rounds.append({r.proposer.handle: (len(r.tokens) - 1, r.k) for r in requests
                                if r.k})
            return propose(requests)

        self.view.forward, group.propose = recorded_forward, recorded_propose


def run_session(specs: list[SpecConfig], monkeypatch, max_batch: int = 2, budget: int = BUDGET,
                lazy: bool = False) -> tuple[BatchSession, list[Sequence], Passes]:
    """PROMPTS decoded greedily under `specs`, at most `max_batch` live (admissions mid-run);
    no StreamingRuntime may be built; the target pool's regions are checked every step."""
    def refused(*args, **kw):
        raise AssertionError("a batch member built a StreamingRuntime (a cache of its own)")

    monkeypatch.setattr("forerun.propose.magicdec.StreamingRuntime", refused)
    session = BatchSession(engine(), budget, max_batch=max_batch, lazy=lazy,
                           max_batch_tokens=16 if lazy else None)
    seqs = [session.sequence(p, GREEDY, n, s)
            for p, s, n in zip(PROMPTS, specs, NEW, strict=True)]
    group = next(s.proposer.group for s in seqs if isinstance(s.proposer, SelfMember))
    passes = Passes(group)
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
        target = session.target  # one region a live member, reserved as a plain member's
        assert target.pool.live == len(session.live)
        if not lazy:
            assert all(target.reserved(s.handle) == s.slots() for s in session.live)
        drafting = [s for s in session.live if s.proposer is not None and
                    s.proposer.name == "draft"]
        assert session._draft is None or session._draft.runtime.pool.live == len(drafting)
    for seq, prompt, n in zip(seqs, PROMPTS, NEW, strict=True):
        assert seq.error is None, seq.error
        assert tokens_of(seq) == _solo(prompt, n)
    assert session.target.pool.live == 0
    return session, seqs, passes


def mixed(k: int) -> list[SpecConfig]:
    """PROMPTS' members: self, draft, self, plain, self."""
    return [self_spec(k), SpecConfig("draft", 3), self_spec(k), SpecConfig("none"), self_spec(k)]


# --- lossless ----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_self_members_equal_plain_in_a_mixed_batch_with_admissions_mid_run(k,
                                                                                  monkeypatch):
    session, seqs, passes = run_session(mixed(k), monkeypatch)
    members = [s for s in seqs if isinstance(s.proposer, SelfMember)]
    assert len(members) == 3 and len({id(s.proposer.group) for s in members}) == 1
    group = members[0].proposer.group
    assert group is session._group[f"{SELF_MAGICDEC} {SINKS} {WINDOW}"]
    assert group.runtime.pool is session.target.pool  # the target's own pool, shared
    assert group.runtime._static is None  # every draft pass eager
    assert all(sum(st.accepted for st in s.steps) > 0 for s in members)
    assert all(sum(st.drafted for st in s.steps) > sum(st.accepted for st in s.steps)
               for s in members) or k == 1
    assert max(len(round_) for round_ in passes.rounds) > 1  # members drafted together


def test_sampled_self_members_have_the_target_joint():
    """Fails by chance with probability ALPHA (`sampled_joint`: the exact joint of its NEW
    tokens); the target drafts for itself over 1 sink + a window of 3 of its own pool."""
    runtime = BatchTorchRuntime(tiny_runtime(0, vocab=V, scale=0.6), BUDGET)
    seqs = sampled_joint(self_spec(K, sinks=1, window=3), {BATCH_TARGET: runtime}, runtime)
    assert all(isinstance(s.proposer, SelfMember) for s in seqs)


def test_a_preempted_self_member_recomputes_and_keeps_its_output(monkeypatch):
    """Lazy regions in a pool too small for everyone: `self` members hold no cache of their
    own, so they are preempted as plain ones, and come back drafting in their new regions."""
    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    per_token = engine().batch_view("target", BUDGET).pool.bytes_per_token
    preempted = []
    preempt = BatchSession._preempt

    def counted(self, seq):
        preempted.append(seq)
        preempt(self, seq)

    monkeypatch.setattr(BatchSession, "_preempt", counted)
    regions: dict[int, list[int]] = defaultdict(list)  # a member's regions, admission by admission
    bind = SelfMember.bind

    def bound(self, seq):
        regions[id(self)].append(seq)
        bind(self, seq)

    monkeypatch.setattr(SelfMember, "bind", bound)
    specs = [self_spec(3), self_spec(4), self_spec(2), SpecConfig("none"), self_spec(3)]
    session, _, passes = run_session(specs, monkeypatch, max_batch=5,
                                     budget=per_token * 200, lazy=True)
    assert session.preempted > 0
    again = [s for s in preempted if isinstance(s.proposer, SelfMember)]
    assert again
    drafted_in = {handle for round_ in passes.rounds for handle in round_}
    for seq in again:  # it came back in another region, and drafted there
        assert len(regions[id(seq.proposer)]) > 1
        assert regions[id(seq.proposer)][-1] in drafted_in


# --- no cache of its own: the drafter's rows are the draft's --------------------------------

def test_the_drafter_prefills_nothing_and_feeds_only_the_draft_rows(monkeypatch):
    """Every pass of the view runs one row a member; a draft of k tokens after L committed
    ones runs rows at positions L .. L+k-1 (the pending token, then each drafted token but the
    last), and leaves the region at L; no pass feeds a prompt."""
    _, seqs, passes = run_session(mixed(3), monkeypatch)
    assert passes.passes and all(rows == 1 for p in passes.passes for _, _, rows, _, _ in p)
    fed: dict[int, list[int]] = defaultdict(list)  # handle -> positions its passes fed
    for p in passes.passes:
        for handle, start, _, _, _ in p:
            fed[handle].append(start)
    wanted: dict[int, list[int]] = defaultdict(list)
    for round_ in passes.rounds:
        for handle, (length, k) in round_.items():
            wanted[handle].extend(range(length, length + k))
    assert {h: sorted(v) for h, v in fed.items()} == {h: sorted(v) for h, v in wanted.items()}
    members = [s for s in seqs if isinstance(s.proposer, SelfMember)]
    assert sum(len(v) for v in fed.values()) == sum(st.drafted for s in members
                                                   for st in s.steps)
    assert min(start for p in passes.passes for _, start, _, _, _ in p) >= min(map(len,
                                                                                  PROMPTS))


def test_each_draft_row_attends_to_the_sinks_and_its_window_only(monkeypatch):
    """The keys each draft row read (`last_keys`) and attended (its mask) are the sinks and
    the window ending at its position: SINKS + WINDOW of them at every context, 51 to 90."""
    _, _, passes = run_session(mixed(5), monkeypatch)
    view, seen = passes.view, set()
    for p in passes.passes:
        for _, start, _, keys, attended in p:
            assert keys == [*range(SINKS), *range(start - WINDOW + 1, start + 1)]
            assert attended == [SINKS + WINDOW]
            seen.add(start)
    assert min(seen) < 55 and max(seen) > 85  # flat from one end of the contexts to the other
    total = sum(len(p) for p in passes.passes)
    assert view.attended == total * (SINKS + WINDOW)


# --- the target's cache after every verify ----------------------------------------------------

def run_kept(methods: list[str], k: int = 3):
    """PROMPTS[:3] decoded by members of one pool as `methods` (three); -> the members, each one's
    final (n, K, V) at release, the regions [L, Hkv, n, hd] after every commit (index, n, K,
    V) and, per draft, the K the view wrote at its rows (index, position, K [L, Hkv, hd])."""
    runtime = BatchTorchRuntime(tiny_runtime(0), BUDGET)
    group = {BATCH_TARGET: runtime}
    seqs = []
    for method, prompt, n in zip(methods, PROMPTS[:3], NEW[:3], strict=True):
        spec = self_spec(k) if method == "self" else SpecConfig("none")
        proposer = None if method == "none" else PROPOSERS["magicdec"](spec, ProposerContext(
            runtime.single, capacity=len(prompt) + n + k + 1, batch=group))
        seqs.append(Sequence(list(prompt), GREEDY, n, make_generator(0), (), proposer,
                             FixedK(k) if proposer else None, max_k=k if proposer else 0))
    pool, final, after, drafted = runtime.pool, {}, [], []
    release, commit = runtime.release, runtime.commit

    def region(handle):
        r = pool.region(handle)
        at = slice(r.start, r.start + r.length)
        return r.length, pool.k[:, :, at].clone(), pool.v[:, :, at].clone()

    def index(handle):
        return next(i for i, s in enumerate(seqs) if s.handle == handle)

    def kept(handle):
        final[index(handle)] = region(handle)
        release(handle)

    def committed(handle, base, rows):
        commit(handle, base, rows)
        if methods[index(handle)] == "self":
            after.append((index(handle), *region(handle)))

    runtime.release, runtime.commit = kept, committed
    if "self" in methods:
        view = next(s.proposer for s in seqs if s.proposer is not None).group.runtime
        draft_pass = view.forward

        def writes(batch, *args, **kw):
            starts = [view.length(s) for s in batch.seqs]
            out = draft_pass(batch, *args, **kw)
            for s, start in zip(batch.seqs, starts, strict=True):
                at = pool.region(s).start + start
                drafted.append((index(s), start, pool.k[:, :, at].clone()))
            return out

        view.forward = writes
    run_to_completion(runtime, seqs)
    return seqs, final, after, drafted


def test_after_every_verify_the_targets_cache_is_a_plain_batchs():
    """After each commit a `self` member's region holds what the same batch of plain members
    holds at its final slots (the draft's rows, written there with sparse attention,
    overwritten by the verify's full-attention ones), to float64 rounding; at release every
    member's region does; and the draft did write other keys there (the check has teeth)."""
    methods = ["self", "none", "self"]
    seqs, final, after, drafted = run_kept(methods)
    plain, ref, _, _ = run_kept(["none"] * len(methods))
    assert [tokens_of(s) for s in seqs] == [tokens_of(s) for s in plain]
    accepted = sum(st.accepted for s in seqs for st in s.steps)
    assert 0 < accepted < sum(st.drafted for s in seqs for st in s.steps)

    def close(a, b):
        return torch.allclose(a, b, rtol=0, atol=1e-12)

    assert len(after) > 10
    for i, n, k_, v_ in after:
        assert close(k_, ref[i][1][:, :, :n]) and close(v_, ref[i][2][:, :, :n]), (i, n)
    for i in range(len(methods)):
        n = min(final[i][0], ref[i][0])  # (the last pass may cache a token more or less)
        assert close(final[i][1][:, :, :n], ref[i][1][:, :, :n]), i
        assert close(final[i][2][:, :, :n], ref[i][2][:, :, :n]), i
    overwritten = [(i, p) for i, p, k_ in drafted
                   if p < ref[i][0] and not close(k_[1:], ref[i][1][1:, :, p])]
    assert len(overwritten) > len(drafted) // 2  # above layer 0 the sparse draft's keys differ


# --- where the batch has no torch target pool ------------------------------------------------

def test_without_the_target_pool_a_self_member_drafts_over_a_cache_of_its_own():
    """A sequence alone, and a batch whose runtime is not the torch pool (no BATCH_TARGET, or
    another runtime under it): the one-sequence view over the target's weights, as before."""
    from forerun.runtime.forked import ForkedBatch

    target = tiny_runtime(0)
    for batch in (None, {}, {SHARED_DRAFT: None, BATCH_TARGET: ForkedBatch(target)}):
        proposer = PROPOSERS["magicdec"](self_spec(), ProposerContext(target, batch=batch))
        assert isinstance(proposer, MagicDecProposer)
        assert isinstance(proposer.runtime, StreamingRuntime)
        assert proposer.runtime.base is target
