"""The server's worker as one continuous batch: shared passes, KV admission, isolation,
cancellation and the speculation policy, on tiny float64 models (greedy speculative output
equals plain greedy output there, tests/test_engine.py), driven through `Worker` directly.

No assertion depends on how fast the machine is: "shared a pass" and "waited for memory" are
read from the batch's own records, not from the clock.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import ClassVar

import pytest
from test_serve import HANG_S, PROMPTS, model_dirs, reference  # noqa: F401 (fixtures)

from forerun import Engine, SpecConfig
from forerun.models.load import open_model
from forerun.profile import ForwardCurve
from forerun.propose import PROPOSERS
from forerun.sampling import SamplingConfig
from forerun.serve.worker import Delta, Done, Failed, Job, Worker

MAX_TOKENS = 16


def engine_of(model_dirs, spec: SpecConfig | None = None) -> Engine:  # noqa: F811
    spec = spec or SpecConfig("ngram", 3)
    src = open_model(str(model_dirs[0]))
    return Engine.from_runtimes(src.load(dtype="float64"), src.tokenizer, spec=spec)


class Collect:
    """Every job's events, and a wait for all of them to end."""

    def __init__(self, n: int):
        self.events: list[list] = [[] for _ in range(n)]
        self._left = threading.Semaphore(0)

    def emit(self, i: int):
        def emit(event):
            self.events[i].append(event)
            if isinstance(event, Done | Failed):
                self._left.release()
        return emit

    def wait(self) -> None:
        for _ in self.events:
            assert self._left.acquire(timeout=HANG_S), "a job never ended"

    def text(self, i: int) -> str:
        return "".join(e.text for e in self.events[i] if isinstance(e, Delta))

    def end(self, i: int) -> Done | Failed:
        return self.events[i][-1]


def run_jobs(worker: Worker, jobs: list[Job]) -> Collect:
    """Submit `jobs` all at once and run them to their ends."""
    out = Collect(len(jobs))
    for i, job in enumerate(jobs):
        job.emit = out.emit(i)
    worker.submit(jobs)
    worker.start()
    try:
        out.wait()
    finally:
        worker.stop()
    return out


def job(engine: Engine, prompt: str, spec: SpecConfig | None = None,
        max_tokens: int = MAX_TOKENS) -> Job:
    return Job(engine.tokenizer.encode_prompt(prompt, raw=True), SamplingConfig(), max_tokens,
               (), spec or engine.spec, emit=print)


def pass_sizes(worker: Worker) -> list[int]:
    """Requests in each pass the worker ran, read off its histogram: (size bucket, count)."""
    sizes = []
    for metric in worker.metrics.batch_sizes.collect():
        buckets = [(float(s.labels["le"]), s.value) for s in metric.samples
                   if s.name.endswith("_bucket")]
        below = 0.0
        for le, count in buckets:
            sizes += [le] * int(count - below)
            below = count
    return sizes


def test_requests_share_passes_and_each_gets_its_solo_output(model_dirs, reference):  # noqa: F811
    engine = engine_of(model_dirs)
    worker = Worker(engine, slots=4, max_queue=4)
    specs = [SpecConfig("ngram", 3), SpecConfig("none"), SpecConfig("ngram", 2),
             SpecConfig("none"), SpecConfig("ngram", 4)]
    out = run_jobs(worker, [job(engine, PROMPTS[i], specs[i]) for i in range(5)])
    for i in range(5):
        assert isinstance(out.end(i), Done), out.end(i)
        assert out.text(i) == reference(PROMPTS[i], MAX_TOKENS).text, f"job {i}"
    sizes = pass_sizes(worker)
    assert max(sizes) == 4  # the batch filled to its slots (the fifth waited)
    assert len(sizes) < 5 * MAX_TOKENS  # far fewer passes than the jobs' steps one by one


def test_the_kv_budget_admits_what_fits_and_the_rest_waits(model_dirs, reference):  # noqa: F811
    engine = engine_of(model_dirs, SpecConfig("none"))
    probe = Worker(engine, slots=4, max_queue=4)
    per_token = probe.session.target.pool.bytes_per_token
    prompt_len = max(len(job(engine, p).ids) for p in PROMPTS[:3])
    # room for one request (prompt + max_tokens + one pass), not two
    budget = per_token * (prompt_len + MAX_TOKENS + 8)
    worker = Worker(engine, slots=4, max_queue=4, kv_cache_bytes=budget, lazy_kv=False)
    too_long = job(engine, PROMPTS[0], max_tokens=10 * MAX_TOKENS)
    out = run_jobs(worker, [job(engine, PROMPTS[i]) for i in range(3)] + [too_long])
    for i in range(3):
        assert out.text(i) == reference(PROMPTS[i], MAX_TOKENS).text, f"job {i}"
    assert set(pass_sizes(worker)) == {1}  # one at a time: each waited for the memory
    assert isinstance(out.end(3), Failed) and "KV cache budget" in out.end(3).message
    assert worker.session.target.pool.free_slots == worker.session.target.pool.slots
    # the KV-in-use gauge reads the pool: it held a request's KV, and nothing once all ended
    assert worker.session.target.kv_peak_bytes() >= per_token * prompt_len
    assert worker.metrics.registry.get_sample_value("forerun_kv_cache_bytes_in_use") == 0


class FailingNgram:
    """An n-gram drafter that raises on its third draft when its prompt is `doomed_prompt`: a
    drafter with a bug, in one request."""

    doomed_prompt: ClassVar[list[int]] = []

    def __init__(self, spec, ctx):
        self.inner, self.drafts, self.doomed = PROPOSERS["ngram"](spec, ctx), 0, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill(self, prompt):
        self.doomed = list(prompt) == FailingNgram.doomed_prompt
        self.inner.prefill(prompt)

    def propose(self, *args, **kw):
        self.drafts += 1
        if self.doomed and self.drafts == 3:
            raise RuntimeError("the drafter's index is corrupt")
        return self.inner.propose(*args, **kw)


def test_a_failing_drafter_fails_its_request_alone(model_dirs, reference, monkeypatch):  # noqa: F811
    monkeypatch.setitem(PROPOSERS, "failing", FailingNgram)
    engine = engine_of(model_dirs)
    worker = Worker(engine, slots=4, max_queue=4, spec_policy="always")
    jobs = [job(engine, p, SpecConfig("failing", 3)) for p in PROMPTS]
    monkeypatch.setattr(FailingNgram, "doomed_prompt", jobs[4].ids)
    out = run_jobs(worker, jobs)
    assert isinstance(out.end(4), Failed)
    assert "RuntimeError: the drafter's index is corrupt" in out.end(4).message
    for i in range(4):
        assert out.text(i) == reference(PROMPTS[i], MAX_TOKENS).text, f"job {i}"
    assert worker.alive is False and worker.restarts == 0  # stopped by us, never crashed


def test_a_cancelled_request_leaves_the_batch_and_frees_its_cache(model_dirs, reference):  # noqa: F811
    engine = engine_of(model_dirs, SpecConfig("none"))
    worker = Worker(engine, slots=2, max_queue=2)
    pool = worker.session.target.pool
    long = job(engine, "x", max_tokens=120)
    assert len(reference("x", 120).token_ids) >= 60  # it would run >= 60 passes
    kept = job(engine, PROMPTS[0])
    events = []

    def emit(event):  # on the worker thread: cancel at the first token
        events.append(event)
        worker.cancel(long)
    long.emit = emit
    done = threading.Event()
    kept.emit = lambda e: done.set() if isinstance(e, Done) else None
    worker.submit([long, kept])
    worker.start()
    try:
        assert done.wait(HANG_S)
        assert len(events) < 5  # dropped within a pass or two, not run to its end
        assert worker.in_flight == (0, 0)
        assert pool.free_slots == pool.slots  # both regions free again
    finally:
        worker.stop()
    assert worker.metrics.finished.labels("cancelled")._value.get() == 1


@pytest.mark.parametrize(("policy", "curve", "drafts"), [
    ("off", None, False),
    ("always", None, True),
    ("adaptive", ForwardCurve((1, 64), (1.0, 1.0)), True),  # rows are free: draft
    ("adaptive", ForwardCurve((1, 2, 64), (1.0, 50.0, 3200.0)), False),  # each row 50x: don't
])
def test_the_spec_policy_decides_from_the_measured_pass_cost(model_dirs, reference, policy, curve,  # noqa: F811
                                                              drafts, monkeypatch):
    engine = engine_of(model_dirs)
    if curve is not None:
        monkeypatch.setattr(engine, "batch_curve", lambda view: curve)
    worker = Worker(engine, slots=2, max_queue=2, spec_policy=policy)
    out = run_jobs(worker, [job(engine, PROMPTS[3], SpecConfig("ngram", 4))])
    stats = out.end(0).stats
    assert out.text(0) == reference(PROMPTS[3], MAX_TOKENS).text
    assert (stats.drafted > 0) == drafts
    assert stats.method == ("none" if policy == "off" else "ngram")
    passes = {s.labels["speculation"]: s.value for m in worker.metrics.passes.collect()
              for s in m.samples if s.name.endswith("_total")}
    if policy != "off":  # passes that drafted (all of k, or what the n-gram index held)
        assert (passes.get("full", 0) + passes.get("reduced", 0) > 0) == drafts


def test_a_failed_target_pass_fails_its_requests_and_the_next_ones_run(model_dirs, reference,  # noqa: F811
                                                                        monkeypatch):
    engine = engine_of(model_dirs, SpecConfig("none"))
    worker = Worker(engine, slots=2, max_queue=4)
    forward, calls = worker.session.target.forward, []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return forward(*args, **kw)

    monkeypatch.setattr(worker.session.target, "forward", flaky)
    out = run_jobs(worker, [job(engine, PROMPTS[i]) for i in range(4)])
    failed = [i for i in range(4) if isinstance(out.end(i), Failed)]
    assert failed == [0, 1]  # the two in the pass that failed
    assert all("device lost" in out.end(i).message for i in failed)
    for i in (2, 3):
        assert out.text(i) == reference(PROMPTS[i], MAX_TOKENS).text
    assert worker.restarts == 0
    assert worker.session.target.pool.free_slots == worker.session.target.pool.slots


def test_a_repeated_chat_history_reuses_its_prefix_and_stays_exact(model_dirs, reference):  # noqa: F811
    engine = engine_of(model_dirs, SpecConfig("none"))
    worker = Worker(engine, slots=2, max_queue=2, prefix_cache_bytes=1 << 20)
    history = "The quick brown fox jumps over the lazy dog. " * 2
    prompts = [history + "Again?", history + "Why?"]
    worker.start()
    try:
        for i, prompt in enumerate(prompts):  # one after the other: the first one's blocks stay
            out = Collect(1)
            worker.submit([replace(job(engine, prompt), emit=out.emit(0))])
            out.wait()
            assert out.text(0) == reference(prompt, MAX_TOKENS).text, prompt
            hits = worker.session.prefix.hits
            assert hits == (0 if i == 0 else len(history) // 16 * 16)
    finally:
        worker.stop()
    gauge = next(m for m in worker.metrics.registry.collect()
                 if m.name == "forerun_prefix_cache_hit_tokens")
    assert gauge.samples[0].value == hits > 0


def test_growing_regions_preempt_and_recompute_with_the_same_output(model_dirs, reference,  # noqa: F811
                                                                     monkeypatch):
    monkeypatch.setattr("forerun.batch_session.GROW_TOKENS", 4)
    engine = engine_of(model_dirs)
    probe = Worker(engine, slots=4, max_queue=4)
    per_token = probe.session.target.pool.bytes_per_token
    longest = max(len(job(engine, p).ids) for p in PROMPTS)
    # two requests' worst case, four in the batch: they overcommit it
    worker = Worker(engine, slots=4, max_queue=4, spec_policy="always",
                    kv_cache_bytes=per_token * 2 * (longest + 2 * MAX_TOKENS + 4))
    out = run_jobs(worker, [job(engine, p, max_tokens=2 * MAX_TOKENS) for p in PROMPTS])
    for i, prompt in enumerate(PROMPTS):
        assert out.text(i) == reference(prompt, 2 * MAX_TOKENS).text, f"job {i}"
    assert worker.session.preempted > 0
    assert worker.metrics.preemptions._value.get() == worker.session.preempted
