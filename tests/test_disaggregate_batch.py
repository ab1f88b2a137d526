"""`--disaggregate` for a batch: one drafter worker, in a process of its own, drafts for every
member of a continuous batch (its pool mode: a region per sequence, one draft pass for all).

Properties (tiny float64 models): greedy, every member's tokens equal its solo plain greedy
output whatever it is batched with (mixed prompt lengths and budgets, members joining as others
leave, a member preempted and recomputed); every member drafted, and every sequence that left
closed its session and freed its region at the worker (six members in turn through a pool of
two members' worst case all draft); draft = target accepts everything; the
sampled members' joint law over NEW_TOKENS tokens is the target's exact one (a chi-square test
against `test_disaggregate.exact_joint`, false-failure rate ALPHA); a worker killed mid-batch
leaves every member decoding plainly to its solo output, and the batch goes on. Through
`forerun serve --disaggregate` (the real CLI in a subprocess, the real `openai` client, requests
at once) every response equals its solo plain greedy output.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import tiny_model, tiny_runtime
from scipy.stats import chisquare
from test_batch_engine import BUDGET, PROMPTS, _solo
from test_disaggregate import (  # noqa: F401  (a fixture)
    ALPHA,
    NEW_TOKENS,
    PROMPT,
    V,
    cli,
    exact_joint,
    pair_dirs,
)
from test_serve import (  # noqa: F401  (fixtures)
    KEY,
    NAME,
    client,
    extra,
    free_port,
    model_dirs,
    reference,
    wait_healthy,
)

from forerun.batch_session import BatchSession
from forerun.propose import SpecConfig
from forerun.propose.disaggregate import DRAFTER, AsyncDraftBatch
from forerun.propose.drafter_hub import DrafterHub
from forerun.propose.drafter_worker import DrafterProcess
from forerun.runtime.torch_model import TorchRuntime
from forerun.sampling import SamplingConfig

DRAFT_CORES = (max(os.sched_getaffinity(0)),)
BATCH_RUNS = 1600  # sampled sequences (members of batches of SAMPLED_BATCH)
SAMPLED_BATCH = 8


@pytest.fixture(autouse=True)
def one_thread():
    """The target on one thread, the worker on a core of its own (see test_disaggregate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_with_worker(k: int = 3, noise: float = 0.3, vocab: int = 64, scale: float = 1.0,
                       wait_s: float = 1.0):
    """An Engine over a tiny target whose draft model runs in a spawned worker."""
    from test_engine import word_tokenizer

    from forerun import Engine

    worker = DrafterProcess(functools.partial(tiny_runtime, 0, vocab=vocab, noise=noise,
                                              scale=scale), vocab, DRAFT_CORES)
    target = TorchRuntime(tiny_model(0, vocab=vocab, scale=scale), capacity=256)
    spec = SpecConfig("draft", k, disaggregate=True, disaggregate_wait=wait_s)
    engine = Engine.from_runtimes(target, word_tokenizer(), None, spec)
    engine.drafter = worker
    engine.proposers.shared[DRAFTER] = DrafterHub(worker)
    return engine, worker


def drain(session: BatchSession, seqs: list) -> list[list[int]]:
    for seq in seqs:
        session.add(seq)
    while not session.idle:
        session.step()
    assert all(seq.error is None for seq in seqs), [seq.error for seq in seqs]
    return [[t for st in seq.steps for t in st.tokens] for seq in seqs]


def test_batched_greedy_with_the_drafter_apart_equals_each_solo_plain_output():
    engine, worker = engine_with_worker()
    try:
        hub = engine.proposers.shared[DRAFTER]
        session = BatchSession(engine, BUDGET, max_batch=4)  # 6 members: joins as others leave
        budgets = [30, 12, 25, 40, 18, 22]
        seqs = [session.sequence(p, SamplingConfig(), n) for p, n in zip(PROMPTS, budgets,
                                                                         strict=True)]
        outputs = drain(session, seqs)
        for prompt, n, out in zip(PROMPTS, budgets, outputs, strict=True):
            assert out == _solo(prompt, n)
        assert all(sum(st.drafted for st in seq.steps) > 0 for seq in seqs)
        assert all(seq.proposer.failure is None for seq in seqs)
        assert isinstance(seqs[0].proposer.group, AsyncDraftBatch)
        assert hub.pool_tokens > 0 and not hub.inboxes  # every session closed: regions freed
        # the engine's one-sequence path shares the pooled worker
        alone = engine.generate(PROMPTS[0], max_tokens=20)
        assert alone.token_ids == _solo(PROMPTS[0], 20)
    finally:
        worker.close()


def test_members_leaving_free_their_regions_at_the_worker():
    """A pool that holds two members' worst case at a time (the worker's as the target's):
    six members in turn all draft, so each one that left freed its region there."""
    engine, worker = engine_with_worker()
    try:
        per_token = engine.batch_view("target", BUDGET).pool.bytes_per_token
        session = BatchSession(engine, per_token * 110)
        seqs = [session.sequence(p, SamplingConfig(), 30) for p in PROMPTS]
        outputs = drain(session, seqs)
        assert outputs == [_solo(p, 30) for p in PROMPTS]
        assert all(seq.proposer.failure is None and sum(st.drafted for st in seq.steps) > 0
                   for seq in seqs)
    finally:
        worker.close()


def test_draft_equal_to_target_accepts_everything_in_a_batch():
    engine, worker = engine_with_worker(k=4, noise=0.0)
    try:
        session = BatchSession(engine, BUDGET)
        seqs = [session.sequence(p, SamplingConfig(), 24) for p in PROMPTS[:4]]
        outputs = drain(session, seqs)
        assert outputs == [_solo(p, 24) for p in PROMPTS[:4]]
        assert all(st.accepted == st.drafted for seq in seqs for st in seq.steps)
        assert sum(st.drafted for seq in seqs for st in seq.steps) > 0
    finally:
        worker.close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_preempted_members_keep_their_output(monkeypatch):
    """Lazily grown regions overcommit the target's pool: the youngest member is preempted
    (its target cache freed and recomputed; its worker region kept) and every output is still
    its solo one. (The worker reserves each member's worst case in a pool of the target's
    tokens: a member it has no room for decodes plainly, with a warning.)"""
    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    engine, worker = engine_with_worker()
    try:
        per_token = engine.batch_view("target", BUDGET).pool.bytes_per_token
        session = BatchSession(engine, per_token * 150, lazy=True, max_batch_tokens=16)
        budgets = [40, 36, 44, 30, 40]
        seqs = [session.sequence(p, SamplingConfig(), n)
                for p, n in zip(PROMPTS[:5], budgets, strict=True)]
        outputs = drain(session, seqs)
        assert session.preempted > 0
        assert any(seq.proposer.failure is None and sum(st.drafted for st in seq.steps)
                   for seq in seqs)
        assert outputs == [_solo(p, n) for p, n in zip(PROMPTS[:5], budgets, strict=True)]
    finally:
        worker.close()


def test_batched_sampling_is_exact_with_the_drafter_apart():
    sampling = SamplingConfig(temperature=1.0)
    engine, worker = engine_with_worker(k=1, noise=0.5, vocab=V, scale=0.4)
    counts: dict[tuple, int] = {}
    try:
        session = BatchSession(engine, BUDGET)
        seed, used = 0, 0
        for _ in range(BATCH_RUNS // SAMPLED_BATCH):
            seqs = []
            for _ in range(SAMPLED_BATCH):
                seed += 1
                seqs.append(session.sequence(list(PROMPT), SamplingConfig(temperature=1.0,
                                                                           seed=seed), NEW_TOKENS))
            for out in drain(session, seqs):
                counts[tuple(out)] = counts.get(tuple(out), 0) + 1
            used += sum(seq.proposer.ahead_used for seq in seqs)
    finally:
        worker.close()
    print(f"nodes drafted ahead and verified: {used}")
    assert used > BATCH_RUNS // 20 and sum(counts.values()) == BATCH_RUNS
    joint = exact_joint(sampling)
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * BATCH_RUNS >= 5]
    small = [c for c in cells if joint[c] * BATCH_RUNS < 5]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [joint[c] * BATCH_RUNS for c in big] + [sum(joint[c] for c in small) * BATCH_RUNS]
    if not small:
        observed, expected = observed[:-1], expected[:-1]
    assert chisquare(observed, expected).pvalue > ALPHA


def test_a_worker_killed_mid_batch_leaves_every_member_plain():
    engine, worker = engine_with_worker(wait_s=1.0)
    try:
        session = BatchSession(engine, BUDGET)
        budgets = [30, 25, 35, 20]
        seqs = [session.sequence(p, SamplingConfig(), n) for p, n in zip(PROMPTS[:4], budgets,
                                                                         strict=True)]
        for seq in seqs:
            session.add(seq)
        started, passes = time.perf_counter(), 0
        with pytest.warns(RuntimeWarning, match="without drafts"):
            while not session.idle:
                session.step()
                passes += 1
                if passes == 4:
                    os.kill(worker.pid, signal.SIGKILL)
        assert all(seq.error is None and seq.proposer.failure is not None for seq in seqs)
        for seq, prompt, n in zip(seqs, PROMPTS[:4], budgets, strict=True):
            assert [t for st in seq.steps for t in st.tokens] == _solo(prompt, n)
        assert time.perf_counter() - started < 20
        # the batch goes on: a later member decodes plainly from the start
        with pytest.warns(RuntimeWarning, match="without drafts"):
            later = drain(session, [session.sequence(PROMPTS[4], SamplingConfig(), 15)])
        assert later == [_solo(PROMPTS[4], 15)]
    finally:
        worker.close()


SERVE_PROMPTS = ["Hello there", "def f(x):", "The quick brown fox", "abcabcabc", "1, 2, 3, 4,"]


def test_serve_disaggregated_answers_equal_solo_greedy(model_dirs, reference,  # noqa: F811
                                                       tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forerun.cli", "serve", "--target", str(model_dirs[0]),
             "--draft", str(model_dirs[1]), "--method", "draft", "-k", "3", "--disaggregate",
             "--draft-cores", str(DRAFT_CORES[0]), "--disaggregate-wait", "0.5",
             "--spec-policy", "always", "--dtype", "float64", "--draft-dtype", "float64",
             "--port", str(port), "--api-key-file", str(key_file), "--served-model-name", NAME,
             "--max-concurrent", "4", "--no-calibrate", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, lambda: proc.poll() is None, log.read_text)

        def ask(prompt: str):
            return client(base).completions.create(model=NAME, prompt=prompt, max_tokens=20,
                                                   temperature=0)

        with ThreadPoolExecutor(len(SERVE_PROMPTS)) as pool:  # 5 requests, 4 at a time
            answers = list(pool.map(ask, SERVE_PROMPTS))
        for prompt, out in zip(SERVE_PROMPTS, answers, strict=True):
            want = reference(prompt, 20)
            assert out.choices[0].text == want.text, prompt
            assert out.usage.completion_tokens == len(want.token_ids)
        assert sum((extra(a.choices[0], "speculation") or {}).get("drafted", 0)
                   for a in answers) > 0  # the worker drafted for them
        assert ask(SERVE_PROMPTS[0]).choices[0].text == reference(SERVE_PROMPTS[0], 20).text
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # (this server's own process, by its id)
        proc.wait(30)
    text = log.read_text()
    assert "Traceback" not in text and "drafting in process instead" not in text, text


def test_generate_batch_disaggregated_equals_plain_batch(pair_dirs, tmp_path):  # noqa: F811
    lines = tmp_path / "batch.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": n}) for p, n in (
        ("Write a sort.", 14), ("abc abc abc", 10), ("Hi", 12), ("def f(x): return", 16))))
    runs = {}
    for name, extra_args in (("plain", ["--method", "none"]),
                             ("apart", ["--disaggregate", "--draft-cores",
                                        str(DRAFT_CORES[0])])):
        r = cli("generate", "--target", str(pair_dirs / "target"), "--draft",
                str(pair_dirs / "draft"), "--dtype", "float64", "--draft-dtype", "float64",
                "--batch", str(lines), "--max-batch", "3", *extra_args)
        assert r.returncode == 0, r.stderr
        assert "drafting in process instead" not in r.stderr
        runs[name] = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["token_ids"] for o in runs["apart"]] == [o["token_ids"] for o in runs["plain"]]
    assert sum(o["stats"]["drafted"] for o in runs["apart"]) > 0
