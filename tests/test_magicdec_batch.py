"""The magicdec method in a batch with the draft model as its drafter: the batch's shared draft
model over a sparse view of its cache pool (`forerun.runtime.streaming_batch`).

Properties (tiny float64 models): greedy members equal their solo plain output in a batch that
mixes magicdec, draft and plain members, admitted while others decode, on contexts several
times longer than sinks + window; sampled members have the target's exact joint (chi-square,
exact enumeration); every row of a pass attends to the sinks and its window and nothing else
(the mask, checked against the definition), and a draft row reads sinks + window keys at any
context (counted, not timed); its logits equal the one-sequence view's (`StreamingRuntime`,
which evicts) on a context ten windows long; with a window as long as the context they equal
the dense runtime's to the bit; `forerun serve --method magicdec` with a draft model serves the
openai client plain's greedy output.

Statistical checks: 1 (the exact joint) at ALPHA = 1e-4: the file fails by chance with
probability below 1e-4 (seeds pinned).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from conftest import tiny_runtime
from exact import RuntimeTable, chi_square_pvalue, target_joint
from test_batch_engine import _solo
from test_engine import word_tokenizer
from test_magicdec import LONG_PROMPT, SINKS, WINDOW
from test_serve import model_dirs, reference  # noqa: F401 (fixtures: the serve test's models)

from forerun import Engine
from forerun.batch_engine import Sequence, run_to_completion
from forerun.batch_session import BatchSession
from forerun.policy import FixedK
from forerun.propose import PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import DraftRequest
from forerun.propose.draft_batch import SHARED_DRAFT, SharedDraftModel
from forerun.propose.magicdec import SHARED_MAGICDEC, PooledMagicDec
from forerun.runtime.batch import BatchTorchRuntime, PackedBatch
from forerun.runtime.streaming import StreamingRuntime
from forerun.runtime.streaming_batch import StreamingBatchRuntime
from forerun.sampling import SamplingConfig, logits_to_probs, make_generator

pytestmark = pytest.mark.usefixtures("one_thread")
BUDGET = 1 << 20  # bytes: ~1,000 tokens of the tiny model


def magicdec(k: int = 3, window: int = WINDOW) -> SpecConfig:
    return SpecConfig("magicdec", k, magicdec_sinks=SINKS, magicdec_window=window)


def engine() -> Engine:
    return Engine.from_runtimes(tiny_runtime(0), word_tokenizer(), tiny_runtime(0, noise=0.05),
                                magicdec())


def view_of(session: BatchSession, window: int = WINDOW) -> StreamingBatchRuntime:
    return session._group[f"{SHARED_MAGICDEC} {SINKS} {window}"].runtime


# --- lossless ----------------------------------------------------------------------------------

def test_greedy_members_equal_plain_in_a_mixed_batch_with_admissions_mid_run():
    """Two live at a time: members join as others finish, magicdec beside draft and plain."""
    session = BatchSession(engine(), BUDGET, max_batch=2)
    prompts = [LONG_PROMPT, LONG_PROMPT[:45], LONG_PROMPT[5:], LONG_PROMPT[:30], LONG_PROMPT[9:]]
    specs = [magicdec(3), SpecConfig("draft", 3), magicdec(4), SpecConfig("none"), magicdec(2)]
    budgets = [30, 20, 25, 15, 28]
    seqs = [session.sequence(p, SamplingConfig(), n, s)
            for p, s, n in zip(prompts, specs, budgets, strict=True)]
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
    for seq, prompt, n in zip(seqs, prompts, budgets, strict=True):
        assert seq.error is None, seq.error
        assert [t for st in seq.steps for t in st.tokens] == _solo(prompt, n)
    magic = [s for s, spec in zip(seqs, specs, strict=True) if spec.method == "magicdec"]
    assert all(isinstance(s.proposer, PooledMagicDec) for s in magic)
    assert len({id(s.proposer.group) for s in magic}) == 1  # one group, one pass a position
    assert all(sum(st.accepted for st in s.steps) > 0 for s in magic)
    view = view_of(session)
    assert view.pool is session._group[SHARED_DRAFT].runtime.pool  # the draft's pool, shared
    assert view.attended > 0 and max(map(len, view.last_keys)) < len(LONG_PROMPT)  # sparse


V, NEW, K, RUNS, ALPHA, BATCH = 4, 4, 3, 2000, 1e-4, 100
SAMPLED_PROMPT = [1, 3, 0, 2, 2, 1, 3, 3, 0, 1]  # 10 tokens: queries past 4 see a window of 3


def test_sampled_members_have_the_target_joint():
    """Fails by chance with probability ALPHA (`sampled_joint`); the drafter sees 1 sink + a
    window of 3 of a perturbed draft model."""
    dense = BatchTorchRuntime(tiny_runtime(0, vocab=V, scale=0.6, noise=0.5), BUDGET)
    spec = SpecConfig("magicdec", K, magicdec_sinks=1, magicdec_window=3)
    seqs = sampled_joint(spec, {SHARED_DRAFT: SharedDraftModel(dense, V)})
    assert all(isinstance(s.proposer, PooledMagicDec) for s in seqs)


def sampled_joint(spec: SpecConfig, group: dict, runtime: BatchTorchRuntime | None = None
                  ) -> list[Sequence]:
    """RUNS members of `spec` (their drafters sharing `group`) sampled after SAMPLED_PROMPT by
    `runtime` (a fresh pool of the target by default), BATCH live at once, each with its own
    seed -> the members, once their joint over NEW tokens passed an asymptotic chi-square at
    ALPHA against the target's exact joint (cells below 5 expected pooled): it fails by chance
    with probability ALPHA."""
    target = tiny_runtime(0, vocab=V, scale=0.6)
    runtime = runtime or BatchTorchRuntime(target, BUDGET)
    sampling = SamplingConfig(temperature=1.0)
    seqs = []
    for i in range(RUNS):
        proposer = PROPOSERS["magicdec"](spec, ProposerContext(runtime.single, capacity=32,
                                                               batch=group))
        seqs.append(Sequence(list(SAMPLED_PROMPT), sampling, NEW, make_generator(i), (),
                             proposer, FixedK(K), max_k=K))
    run_to_completion(runtime, seqs, max_batch=BATCH)
    counts = defaultdict(int)
    for seq in seqs:
        counts[tuple(t for st in seq.steps for t in st.tokens)] += 1
    drafted = sum(st.drafted for s in seqs for st in s.steps)
    accepted = sum(st.accepted for s in seqs for st in s.steps)
    assert 0 < accepted < drafted  # both outcomes of the verifier were exercised
    table = RuntimeTable(tiny_runtime(0, vocab=V, scale=0.6))

    def row(prefix):
        return logits_to_probs(table.logits((*SAMPLED_PROMPT, *prefix)), sampling)

    assert chi_square_pvalue(target_joint(row, NEW), counts) > ALPHA
    return seqs


# --- the view: what it attends to, what it costs ----------------------------------------------

def test_every_row_attends_to_the_sinks_and_its_window_only():
    view = StreamingBatchRuntime(BatchTorchRuntime(tiny_runtime(0), BUDGET), SINKS, WINDOW)
    seqs = [view.add(200), view.add(200)]
    for n in range(30):  # member 0 one row a pass (three every 7th), member 1 five
        rows = [3 if n % 7 == 0 else 1, 5]
        starts = [view.length(s) for s in seqs]
        view.forward(PackedBatch.of([(s, torch.arange(r) % 64)
                                     for s, r in zip(seqs, rows, strict=True)]))
        for b, (start, r) in enumerate(zip(starts, rows, strict=True)):
            held, mask = view.last_keys[b], view.last_masks[b]
            assert mask.shape == (r, len(held))
            for i, mask_row in enumerate(mask.tolist()):
                p = start + i
                seen = {held[c] for c, on in enumerate(mask_row) if on}
                assert seen == {j for j in range(p + 1) if j < SINKS or j > p - WINDOW}, (n, b)


def test_a_draft_row_reads_sinks_plus_window_keys_at_any_context():
    """One propose of 4 tokens for members at contexts 20 to 200 in one batch, after their
    catch-up: each draft row attends to sinks + window positions and reads no more keys."""
    target = tiny_runtime(0)
    group = {SHARED_DRAFT: SharedDraftModel(BatchTorchRuntime(tiny_runtime(0, noise=0.05),
                                                              BUDGET), 64)}
    contexts = (20, 60, 120, 200)
    members, sequences = [], []
    for length in contexts:
        proposer = PROPOSERS["magicdec"](magicdec(4), ProposerContext(target, capacity=240,
                                                                      batch=group))
        tokens = [(5 * i + length) % 63 + 1 for i in range(length)]
        proposer.prefill(tokens)
        proposer.propose(tokens, 4, SamplingConfig(), make_generator(0))  # the catch-up
        proposer.commit(length)
        members.append(proposer)
        sequences.append([*tokens, 7])  # one new token each: one row a member a pass
    shared = members[0].group
    view, before, keys = shared.runtime, shared.runtime.attended, []
    read = view.forward  # count the keys each member's row reads, pass by pass

    def counted(batch):
        out = read(batch)
        keys.append([len(k) for k in view.last_keys])
        return out

    view.forward = counted
    shared.propose([DraftRequest(m, s, 4, SamplingConfig(), make_generator(0))
                    for m, s in zip(members, sequences, strict=True)])
    assert view.attended - before == len(contexts) * 4 * (SINKS + WINDOW)
    assert keys == [[SINKS + WINDOW] * len(contexts)] * 4


def test_a_window_as_long_as_the_context_is_the_dense_runtime_to_the_bit():
    """Same pool, same weights: members of the dense runtime and of the view fed the same
    passes (prompts, single rows, chains, rollbacks) get the same logits, bit for bit."""
    dense = BatchTorchRuntime(tiny_runtime(0, noise=0.05), BUDGET)
    view = StreamingBatchRuntime(dense, SINKS, 10_000)
    pairs = [(dense.add(150), view.add(150)) for _ in range(2)]
    feeds = [[LONG_PROMPT, LONG_PROMPT[:20]], [[3], [4, 5, 6]], [[7, 8], [9]], [[1], [2]]]
    for step in range(12):
        rows = feeds[min(step, len(feeds) - 1)]
        out = [rt.forward(PackedBatch.of([(pair[i], torch.tensor(t))
                                          for pair, t in zip(pairs, rows, strict=True)]))
               for i, rt in enumerate((dense, view))]
        assert torch.equal(out[0].logits, out[1].logits), step
        if step % 3 == 2:  # a rejected draft: both roll back one token
            for d, v in pairs:
                dense.truncate(d, dense.length(d) - 1)
                view.truncate(v, view.length(v) - 1)


def test_a_draft_of_another_runtime_fails_clearly():
    from forerun.runtime.forked import ForkedBatch

    group = {SHARED_DRAFT: SharedDraftModel(ForkedBatch(tiny_runtime(0)), 64)}
    with pytest.raises(ValueError, match="--magicdec-drafter self"):
        PROPOSERS["magicdec"](magicdec(), ProposerContext(tiny_runtime(0), batch=group))


# --- the server ---------------------------------------------------------------------------------

def test_forerun_serve_runs_magicdec_with_the_draft_model(model_dirs, reference,  # noqa: F811
                                                          tmp_path):
    from test_serve import KEY, client, free_port, wait_healthy

    port, key_file = free_port(), tmp_path / "key"
    key_file.write_text(KEY + "\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forerun.cli", "serve", "--target", str(model_dirs[0]),
             "--draft", str(model_dirs[1]), "--method", "magicdec", "--magicdec-sinks", "2",
             "--magicdec-window", "4", "-k", "3", "--spec-policy", "always", "--dtype",
             "float64", "--draft-dtype", "float64", "--port", str(port), "--api-key-file",
             str(key_file), "--max-concurrent", "4", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, lambda: proc.poll() is None, log.read_text)
        api = client(base)
        for prompt in ("The quick brown fox jumps over", "def f(x): return x"):
            got = api.completions.create(model=api.models.list().data[0].id, prompt=prompt,
                                         max_tokens=12, temperature=0)
            assert got.choices[0].text == reference(prompt, 12).text
    finally:
        proc.terminate()
        proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()


def test_the_batched_view_computes_what_the_one_sequence_view_computes():
    """The sparse pass itself (keys gathered from the band, not only the mask): the batched
    view's logits equal `StreamingRuntime`'s (its own cache, evicting) on a context ten
    windows long, pass by pass, to float64 rounding."""
    draft = tiny_runtime(0, noise=0.05)
    view = StreamingBatchRuntime(BatchTorchRuntime(draft, BUDGET), SINKS, WINDOW)
    alone = StreamingRuntime(draft, SINKS, WINDOW, pass_rows=8, rollback=8)
    seq = view.add(150)
    feeds = [LONG_PROMPT[:7], LONG_PROMPT[7:], *[[t] for t in LONG_PROMPT[:20]], [5, 6, 7]]
    for tokens in feeds:
        got = view.forward(PackedBatch.of([(seq, torch.tensor(tokens))])).logits
        want = alone.forward(torch.tensor(tokens)).logits
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-10)
    assert alone.evicted > SINKS and len(view.last_keys[0]) == SINKS + WINDOW + 2
