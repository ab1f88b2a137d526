"""Early exit in a batch: members draft in their own regions of the batch's cache pool, and the
verify pass resumes their draft rows at the exit layer beside every other member's rows.

Properties (tiny float64 models): greedy, early-exit members (two exit layers) batched with plain
and draft-model members each get their plain solo output, for several k, and draft in the shared
pool (no cache of their own); after every pass the pool's layers below E at an early-exit
member's final tokens equal, to the bit, what a batch of plain members wrote there; inside the
verify pass the layers below E run every row but the resumed ones (counted per block call), the
draft ran them one row at a time in the member's region; the resumed pass's logits equal a
plain pass's; a preempted early-exit member (lazy regions) still gets its output; sampled, an
early-exit member's joint over NEW tokens is the target's exact joint (chi-square at ALPHA:
this file fails by chance with probability below ALPHA); members under the cost policy time
their draft before they have a region, and still get their solo output.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model
from exact import Recorder, RuntimeTable, chi_square_pvalue, target_joint

from forerun.batch_engine import Sequence, run_to_completion
from forerun.policy import POLICIES
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import BATCH_TARGET
from forerun.reference import plain_decode
from forerun.runtime.base import Resume
from forerun.runtime.batch import BatchTorchRuntime, PackedBatch
from forerun.runtime.early_exit import ExitDraft
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

LAYERS = 6
BUDGET = 1 << 20  # bytes: ~1,000 tokens of the tiny model
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [10, 20, 30, 40, 50, 60], [7, 7, 8],
           [1, 2, 3, 1, 2, 3, 1], [5, 4, 3, 2, 1, 5, 4]]
# (method, exit layer, prompt, new tokens): two exits, a plain member, a draft-model member
MIX = [("early-exit", 2, 0, 30), ("none", 0, 1, 20), ("draft", 0, 2, 25),
       ("early-exit", 4, 3, 28), ("early-exit", 2, 4, 16)]
GREEDY = SamplingConfig()
ALPHA = 1e-4


def target(seed: int = 0, invariant: bool = False, **kw) -> TorchRuntime:
    """The tiny float64 target, or (`invariant`) in float32 with row-invariant kernels: a
    row's bits then do not depend on the rows beside it (float64's one-row matmuls round
    otherwise than many-row ones; forerun.runtime.torch_model.MIN_MATMUL_ROWS)."""
    model = tiny_model(seed, n_layers=LAYERS, **kw)
    return TorchRuntime(model.float() if invariant else model, capacity=256,
                        invariant=invariant)


def member(runtime: BatchTorchRuntime, method: str, k: int, layer: int, prompt: list[int],
           max_new: int, sampling: SamplingConfig = GREEDY, generator=None) -> Sequence:
    """A batch member of `runtime`'s pool; early exit drafts in its region (BATCH_TARGET)."""
    generator = generator or make_generator(0)
    if method == "none":
        return Sequence(list(prompt), sampling, max_new, generator, ())
    draft = (TorchRuntime(tiny_model(0, noise=0.05, n_layers=2).to(runtime.single.dtype),
                          capacity=256) if method == "draft" else None)
    spec = SpecConfig(method, k, exit_layer=layer or None)
    ctx = ProposerContext(runtime.single, draft, capacity=len(prompt) + max_new + k + 1,
                          batch={BATCH_TARGET: runtime})
    proposer = PROPOSERS[method](spec, ctx)
    return Sequence(list(prompt), sampling, max_new, generator, (), proposer,
                    POLICIES["fixed"](spec, runtime.single, proposer.runtime), max_k=k)


def tokens_of(seq) -> list[int]:
    return [t for s in seq.steps for t in s.tokens]


def solo(prompt: list[int], max_new: int) -> list[int]:
    steps = plain_decode(target(), list(prompt), GREEDY, max_new, (), make_generator(0))
    return [t for s in steps for t in s.tokens]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_members_beside_plain_and_draft_members_equal_their_solo_output(k):
    runtime = BatchTorchRuntime(target(), BUDGET)
    seqs = [member(runtime, m, k, e, PROMPTS[p], n) for m, e, p, n in MIX]
    run_to_completion(runtime, seqs)
    for seq, (method, layer, p, n) in zip(seqs, MIX, strict=True):
        assert tokens_of(seq) == solo(PROMPTS[p], n), (method, layer)
        if method != "none":
            assert sum(s.drafted for s in seq.steps) > 0
        if method == "early-exit":
            view = seq.proposer.runtime
            assert isinstance(view, ExitDraft) and view.pool is runtime and view.k_cache is None
            assert seq.proposer.needs.resume and view.layer == layer
    assert runtime.pool.live == 0


def run_kept(k: int, methods: list[str], invariant: bool
             ) -> tuple[list[Sequence], dict[int, tuple], list[tuple]]:
    """Run MIX's members as `methods`; -> the members, each one's (n, pool K, V [L, Hkv, n,
    hd]) at release (slots of its n final tokens), and before every pass each early-exit
    member's (index, n, K, V) at the n final slots the last pass committed."""
    runtime = BatchTorchRuntime(target(2, invariant, scale=0.3), BUDGET)  # flat: some rejected
    seqs = [member(runtime, m, k, e, PROMPTS[p], n)
            for m, (_, e, p, n) in zip(methods, MIX, strict=True)]
    pool, final, during = runtime.pool, {}, []
    release, step = runtime.release, runtime.forward

    def region(handle):
        r = pool.region(handle)
        at = slice(r.start, r.start + r.length)
        return r.length, pool.k[:, :, at].clone(), pool.v[:, :, at].clone()

    def kept(handle):
        final[next(i for i, s in enumerate(seqs) if s.handle == handle)] = region(handle)
        release(handle)

    def forward(batch, *args, **kw):  # the final slots as the last pass committed them
        during.extend((i, *region(s.handle)) for i, s in enumerate(seqs)
                      if s.handle in batch.seqs and methods[i] == "early-exit")
        return step(batch, *args, **kw)

    runtime.release, runtime.forward = kept, forward
    run_to_completion(runtime, seqs)
    return seqs, final, during


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("k", [2, 4])
def test_the_pool_below_the_exit_holds_a_plain_batchs_cache(k, invariant):
    """Before every pass (after the draft's writes, the verify's resumed rows and the rollback
    of rejected ones): an early-exit member's final slots hold at layers 0..E-1 what the same
    batch with plain members in its place wrote there: to the bit with row-invariant kernels;
    in float64 to 1e-12 (a drafted row's lower layers ran in one-row matmuls, a plain pass's
    in many-row ones: the same math, rounded otherwise). At release so do the other members'
    every layer, and an early-exit member's upper layers to 1e-12 (float32: 1e-5; its verify
    rows attend over more masked keys than a plain one-token step's, as any draft's)."""
    methods = [m for m, *_ in MIX]
    seqs, final, during = run_kept(k, methods, invariant)
    plain, ref, _ = run_kept(k, ["none" if m == "early-exit" else m for m in methods],
                             invariant)

    def same(a, b, tol=1e-12):
        return torch.equal(a, b) if invariant else torch.allclose(a, b, rtol=0, atol=tol)

    assert [tokens_of(s) for s in seqs] == [tokens_of(s) for s in plain]
    assert sum(s.accepted for s in seqs[0].steps) > 0  # drafts accepted, and some rejected
    assert sum(s.accepted for s in seqs[0].steps) < sum(s.drafted for s in seqs[0].steps)
    for i, n, k_, v_ in during:
        layer = MIX[i][1]
        assert same(k_[:layer], ref[i][1][:layer, :, :n])
        assert same(v_[:layer], ref[i][2][:layer, :, :n])
    assert len(during) > 10
    for i, method in enumerate(methods):
        n = min(final[i][0], ref[i][0])  # (the last pass may cache a token more or less)
        layer = MIX[i][1] if method == "early-exit" else LAYERS
        for got, want in ((final[i][1], ref[i][1]), (final[i][2], ref[i][2])):
            assert same(got[:layer, :, :n], want[:layer, :, :n]), i
            assert torch.allclose(got[:, :, :n], want[:, :, :n], rtol=0,
                                  atol=1e-5 if invariant else 1e-12), i


def test_the_verify_pass_runs_the_lower_layers_for_the_rows_not_resumed_alone():
    """Rows of each block call, counted: a draft step runs blocks 0..E-1 over one row in the
    member's region (`lower`); in a verify pass blocks 0..E-1 run every row of the pass but
    each early-exit member's resumed ones (its pending token and all drafted but the last),
    blocks E.. every row."""
    runtime = BatchTorchRuntime(target(), BUDGET)
    seqs = [member(runtime, m, 3, e, PROMPTS[p], n) for m, e, p, n in MIX[:4]]
    calls: list[tuple[int, int]] = []
    passes: list[tuple[PackedBatch, list[tuple[int, int]]]] = []
    block, forward = runtime._block, runtime.forward

    def counted(layer, i, x, *args):
        calls.append((i, x.shape[0]))
        return block(layer, i, x, *args)

    def pass_(batch, *args, **kw):
        calls.clear()
        out = forward(batch, *args, **kw)
        passes.append((batch, list(calls)))
        calls.clear()
        return out

    runtime._block, runtime.forward = counted, pass_
    lowered = runtime.lower
    drafted: list[int] = []

    def lower(seq, tokens, start, layers):
        drafted.append(len(tokens))
        return lowered(seq, tokens, start, layers)

    runtime.lower = lower
    run_to_completion(runtime, seqs)
    assert drafted and set(drafted) == {1}  # a draft step: one row
    resumed_passes = 0
    for batch, rows in passes:
        if batch.resume is None:
            assert rows == [(i, len(batch.tokens)) for i in range(LAYERS)]
            continue
        resumed_passes += 1
        N = len(batch.tokens)
        skipped = {b: r for b, r in enumerate(batch.resume) if r is not None}
        for b, r in skipped.items():  # every row of its verify but the last draft token's
            T = batch.cu[b + 1] - batch.cu[b]  # (all of them where the engine cut the draft)
            assert r.rows in (T - 1, T) and r.rows >= 1
        want = [(i, N - sum(r.rows for r in skipped.values() if i < r.layer))
                for i in range(LAYERS)]
        assert rows == want, (rows, want)
    assert resumed_passes > 5


@pytest.mark.parametrize("invariant", [False, True])
def test_a_resumed_batch_pass_equals_a_plain_one(invariant):
    """The seam alone: two members, each with rows whose lower layers a draft ran in its
    region (exits 2 and 4; one member's every row), beside a plain member: the logits, hidden
    states and cache of the pass that runs every layer of every row (row-invariant kernels: to
    the bit; float64: to 1e-12, one-row matmuls rounding otherwise)."""
    def pass_of(resumed: bool):
        runtime = BatchTorchRuntime(target(3, invariant), BUDGET)
        seqs = [runtime.add(32) for _ in range(3)]
        runtime.forward(PackedBatch.of([(s, torch.tensor(p)) for s, p in
                                        zip(seqs, PROMPTS, strict=False)]))
        news = [torch.tensor([11, 12, 13]), torch.tensor([14]), torch.tensor([15, 16])]
        resume: list[Resume | None] = [None, None, None]
        if resumed:
            for b, layer, m in ((0, 2, 2), (2, 4, 2)):  # member 2: every row resumed
                start = runtime.length(seqs[b])
                hidden = torch.cat([runtime.lower(seqs[b], news[b][j:j + 1], start + j, layer)
                                    for j in range(m)])
                resume[b] = Resume(layer, hidden)
        batch = PackedBatch.of(list(zip(seqs, news, strict=True)))
        out = runtime.forward(replace(batch, resume=tuple(resume) if resumed else None),
                              (4, -1))
        return out, runtime.pool.k[:, :, :runtime.pool.slots].clone()

    def same(a, b):
        return torch.equal(a, b) if invariant else torch.allclose(a, b, rtol=0, atol=1e-12)

    (plain, plain_k), (got, got_k) = pass_of(False), pass_of(True)
    assert same(got.logits, plain.logits) and same(got_k, plain_k)
    assert same(got.hidden[4], plain.hidden[4]) and same(got.hidden[-1], plain.hidden[-1])


def test_a_resumed_pass_refuses_trees_and_hidden_layers_below_the_exit():
    runtime = BatchTorchRuntime(target(), BUDGET)
    seq = runtime.add(16)
    runtime.forward(PackedBatch.of([(seq, torch.tensor(PROMPTS[0]))]))
    hidden = runtime.lower(seq, torch.tensor([3]), runtime.length(seq), 2)
    chain = PackedBatch.of([(seq, torch.tensor([3, 4]))])
    with pytest.raises(ValueError, match="no hidden state below layer 2"):
        runtime.forward(replace(chain, resume=(Resume(2, hidden),)), (1,))
    tree = PackedBatch.of([(seq, torch.tensor([3, 4]))],
                          tree_masks=[torch.ones(2, 2, dtype=torch.bool).tril()])
    with pytest.raises(ValueError, match="of a tree"):
        runtime.forward(replace(tree, resume=(Resume(2, hidden),)))


def test_a_preempted_early_exit_member_recomputes_and_keeps_its_output(monkeypatch):
    """Lazy regions in a pool too small for everyone: members are preempted and recomputed
    (early-exit ones bound to their new regions) and each still gets its solo output."""
    from test_engine import word_tokenizer

    from forerun import Engine
    from forerun.batch_session import BatchSession

    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    engine = Engine.from_runtimes(target(), word_tokenizer(), None,
                                  SpecConfig("early-exit", 3, exit_layer=2))
    budgets = [40, 36, 44, 30, 40]
    per_token = engine.batch_view("target", BUDGET).pool.bytes_per_token
    session = BatchSession(engine, per_token * 150, lazy=True, max_batch_tokens=16)
    seqs = [session.sequence(p, GREEDY, n) for p, n in zip(PROMPTS, budgets, strict=True)]
    for s in seqs:
        session.add(s)
    while not session.idle:
        session.step()
    assert session.preempted > 0
    for seq, p, n in zip(seqs, PROMPTS, budgets, strict=True):
        assert seq.error is None and tokens_of(seq) == solo(p, n)
        assert seq.proposer.runtime.pool is session.target


V, K, NEW, RUNS = 3, 3, 5, 2000  # NEW = K + 2: the first draft after the prefill is K deep
SAMPLED_PROMPT = [1, 2, 0, 1, 2, 0, 1]
SAMPLED = SamplingConfig(temperature=1.0)


def test_sampled_early_exit_in_a_batch_matches_the_target_joint(one_thread):
    """Fails by chance with probability ALPHA = 1e-4 (asymptotic chi-square over the exact
    joint of NEW tokens, cells below 5 expected pooled). Each run: the sampled early-exit member
    (2 of 4 layers) beside a plain member in one pool, its verify resuming its draft rows."""
    rt = TorchRuntime(tiny_model(5, vocab=V, n_layers=4), capacity=64)
    table = RuntimeTable(TorchRuntime(tiny_model(5, vocab=V, n_layers=4), capacity=64))
    runtime = BatchTorchRuntime(rt, BUDGET)
    generator, counts = make_generator(11), defaultdict(int)
    depths: dict[int, int] = defaultdict(int)
    accepted = drafted = 0
    for _ in range(RUNS):
        seq = member(runtime, "early-exit", K, 2, SAMPLED_PROMPT, NEW, SAMPLED, generator)
        seq.proposer = recorder = Recorder(seq.proposer)
        beside = member(runtime, "none", 0, 0, [2, 1, 0], 3)
        run_to_completion(runtime, [seq, beside])
        counts[tuple(tokens_of(seq))] += 1
        accepted += sum(s.accepted for s in seq.steps)
        drafted += sum(s.drafted for s in seq.steps)
        for d, n in recorder.depths.items():
            depths[d] += n
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert min(depths[d] for d in range(1, K + 1)) >= RUNS // 2  # deep, not one token

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), SAMPLED)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA


def test_members_under_the_cost_policy_time_their_draft_before_admission():
    """The cost policy times a member's draft as it is built, before the member has a region
    in the pool: the draft runs on a small cache of its own then, and in its region after."""
    runtime = BatchTorchRuntime(target(), BUDGET)
    seqs = []
    for p, new in ((0, 20), (3, 18)):
        spec = SpecConfig("early-exit", 4, exit_layer=2, policy="cost")
        ctx = ProposerContext(runtime.single, None, capacity=len(PROMPTS[p]) + new + 5,
                              batch={BATCH_TARGET: runtime})
        proposer = PROPOSERS["early-exit"](spec, ctx)
        seqs.append(Sequence(list(PROMPTS[p]), GREEDY, new, make_generator(0), (), proposer,
                             POLICIES["cost"](spec, runtime.single, proposer.runtime), max_k=4))
        assert proposer.runtime.curve is not None  # timed, with no region yet
    run_to_completion(runtime, seqs)
    for s, (p, new) in zip(seqs, ((0, 20), (3, 18)), strict=True):
        assert s.proposer.runtime.pool is runtime
        assert tokens_of(s) == solo(PROMPTS[p], new)
