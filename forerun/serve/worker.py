"""The model-owning worker: one thread, a FIFO of jobs, and one continuous batch over them.

Owns: the only code that touches the models, the queue of waiting jobs, and how much to
speculate under load. HTTP handlers call `submit` and `cancel` from the event loop; everything
else runs on the worker thread. A job's results go back through its `emit` callback (which must
be thread-safe) as `Delta` events, then one `Done` or `Failed`.

Scheduling. The worker drives one `BatchSession` (`forerun.batch_session`). Every loop, the
jobs submitted since the last one join the session's FIFO; the session admits them in arrival
order while its KV memory (`kv_cache_bytes`) and `slots` (the most requests decoded at once)
allow, runs one target pass over every live request (prompts chunked under
`max_batch_tokens`, so that a long one never stalls the decodes around it) and retires the
finished. With `lazy_kv` a request reserves its prompt and a little more and grows as it
decodes; when memory runs out the youngest request is preempted (its cache freed) and
recomputed when it comes back, its output unchanged. Without it each reserves its prompt +
max_tokens up front. A request that does not fit waits; beyond `slots + max_queue` requests in
flight, `submit` refuses (429). A prompt that begins like an earlier one takes those blocks'
KV from the session's prefix cache (`prefix_cache_bytes`) and feeds only the rest. Each
request's tokens are exactly the ones it would get alone (batch invariance:
tests/test_batch_*.py, tests/test_prefix_cache.py).

Speculation under load, `spec_policy`:
- adaptive (default): the batch cost policy chooses every request's draft length together at
  every pass, from the measured cost of a pass as a function of its rows (the request's k is
  its cap), so drafting shrinks as the batch fills and comes back as it empties;
- always: each request drafts by its own length policy, whatever the load;
- off: plain decoding for every request.
`LoadShedding` caps k further by the number of requests in flight (full, reduced: half of k,
off), read before every pass.

Cancellation. `cancel` drops a waiting job at once; a running one leaves the batch before the
next pass, its cache free at once (`BatchSession.drop`).

Failures. A request whose drafter raises fails alone (`Failed`, a short message; the traceback
goes to the log) and the batch goes on. A target pass that raises fails the requests it held
(they shared it); waiting requests go on. A crash of the bookkeeping (a bug) fails the running
jobs and restarts the loop; after MAX_RESTARTS such crashes the worker stops for good and
calls `on_fatal` (the serve command then exits non-zero, for a supervisor).

Online distillation (`forerun.train.online`, --online-distill). With a `distiller`, every
request's Medusa drafter hands it the positions it got wrong, its trainer thread updates a copy
of the head in the background, and the worker swaps the newest trained weights into the live
head between passes, never during one: the output is the target's whatever the head drafts.

Calibration. The batch cost policy prices a pass from a curve of pass times measured at first
use, and a request's own cost policy or an automatic tree from the one-sequence curve;
`calibrate` measures them before serving, so that no pass stalls every request to time them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from forerun.api import DEFAULT_KV_BUDGET_BYTES, Engine
from forerun.batch_engine import Sequence
from forerun.batch_session import BatchSession
from forerun.metrics import GenerationStats, Step
from forerun.models.catalog import ModelError
from forerun.profile import calibrated_curve
from forerun.propose import SpecConfig
from forerun.propose.heads import AUTO_TREE, AUTO_TREE_MAX
from forerun.runtime.memory import return_free_memory
from forerun.sampling import SamplingConfig
from forerun.serve.limits import MAX_ERROR_CHARS, MAX_K, MAX_RESTARTS, SPEC_POLICIES
from forerun.serve.metrics import ServerMetrics
from forerun.stopping import TextOut

if TYPE_CHECKING:
    from forerun.train.online import OnlineDistiller

log = logging.getLogger("forerun.serve")
CRASHED = "the server hit an internal error and dropped this request (see its log); retry"


def short_error(e: BaseException) -> str:
    """What a client is told of an exception: its type and first line, cut short."""
    first = (str(e).splitlines() or [""])[0]
    if len(first) > MAX_ERROR_CHARS:
        first = first[:MAX_ERROR_CHARS] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


@dataclass(frozen=True)
class LoadShedding:
    """Above `reduce_above` jobs in flight, draft at most half of k; above `off_above`, none.
    None: never."""

    reduce_above: int | None = None
    off_above: int | None = None

    def mode(self, in_flight: int) -> str:
        if self.off_above is not None and in_flight > self.off_above:
            return "off"
        if self.reduce_above is not None and in_flight > self.reduce_above:
            return "reduced"
        return "full"


def k_cap(mode: str, k: int) -> int:
    """The most draft tokens a job configured with k may propose in this mode (full: no cap, so
    that an adaptive policy may still grow past k)."""
    if mode == "off":
        return 0
    return max(1, k // 2) if mode == "reduced" else sys.maxsize


@dataclass(frozen=True)
class Delta:
    index: int  # the choice this belongs to (n > 1)
    text: str
    token_ids: list[int]
    step: Step
    stats: dict  # running speculation counters of this choice (see Tally)


@dataclass(frozen=True)
class Done:
    index: int
    finish_reason: str  # "stop" or "length"
    stats: GenerationStats
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    index: int
    message: str


Event = Delta | Done | Failed


@dataclass(eq=False)  # jobs are compared by identity (queue removal)
class Job:
    ids: list[int]
    sampling: SamplingConfig
    max_tokens: int
    stop: tuple[str, ...]
    spec: SpecConfig
    emit: Callable[[Event], None]
    index: int = 0
    logprobs: int | None = None  # alternatives per token's logprob (None: not asked)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class Tally:
    """Running speculation counters of one sequence, with the definitions of forerun.metrics."""

    new_tokens: int = 0
    target_forward_passes: int = 0
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, step: Step) -> None:
        self.new_tokens += len(step.tokens)
        self.target_forward_passes += 1
        self.verify_steps += not step.prefill
        self.drafted += step.drafted
        self.accepted += step.accepted

    def to_dict(self) -> dict:
        return {"new_tokens": self.new_tokens,
                "target_forward_passes": self.target_forward_passes, "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": ((self.accepted + self.verify_steps) / self.verify_steps
                                         if self.verify_steps else 0.0)}


@dataclass(eq=False)
class Running:
    """A job in the batch session (waiting for memory or live): its member and its text."""

    job: Job
    seq: Sequence
    text: TextOut
    spec: SpecConfig  # what it decodes with (method none under --spec-policy off)
    steps: list[Step] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    last_token_time: float | None = None


class Busy(Exception):
    """The batch is full and the queue is full."""


class Stopped(Exception):
    """The worker has stopped: no new jobs."""


class Worker:
    def __init__(self, engine: Engine, *, slots: int, max_queue: int,
                 kv_cache_bytes: int = DEFAULT_KV_BUDGET_BYTES,
                 max_batch_tokens: int | None = None, spec_policy: str = "adaptive",
                 prefix_cache_bytes: int = 0, lazy_kv: bool = True,
                 shedding: LoadShedding | None = None, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[], None] | None = None,
                 distiller: OnlineDistiller | None = None):
        if slots < 1 or max_queue < 0:
            raise ValueError(f"need slots >= 1 and max_queue >= 0, got {slots} and {max_queue}")
        if spec_policy not in SPEC_POLICIES:
            raise ValueError(f"spec_policy must be one of {', '.join(SPEC_POLICIES)}, "
                             f"got {spec_policy!r}")
        if kv_cache_bytes < 1 or (max_batch_tokens is not None and max_batch_tokens < 1):
            raise ValueError("the KV cache budget and max_batch_tokens must be positive")
        self.engine, self.slots, self.max_queue = engine, slots, max_queue
        self.spec_policy = spec_policy
        self.shedding = shedding or LoadShedding()
        self.metrics = metrics or ServerMetrics()
        self.session = BatchSession(engine, kv_cache_bytes, joint=spec_policy == "adaptive",
                                    max_batch=slots, max_batch_tokens=max_batch_tokens,
                                    prefix_cache_bytes=prefix_cache_bytes, lazy=lazy_kv)
        self._waiting: deque[Job] = deque()  # submitted, not yet in the session
        self._runs: dict[int, Running] = {}  # id(seq) -> the jobs in the session
        self._counts = (0, 0)  # (live, waiting in the session), as of the last pass
        self._cond = threading.Condition()
        self._stopping = False
        self.restarts = 0  # crashes of the loop recovered from
        self.on_fatal = on_fatal  # called from the worker thread when it stops for good
        self.mode = "full"
        self.metrics.slots.set(slots)
        self.metrics.kv_budget.set(kv_cache_bytes)
        self.metrics.spec_policy.state(spec_policy)
        self.metrics.watch_prefix_cache(self.session.prefix)
        self.metrics.watch_kv(self.session.kv_bytes)
        self.metrics.set_mode(self.mode)
        self.distiller = distiller  # online distillation of the Medusa head (None: off)
        if distiller is not None:
            distiller.attach(engine.proposers.shared)
            self.metrics.watch_online(distiller)
        self._thread = threading.Thread(target=self._loop, name="forerun-worker", daemon=True)

    # --- called from other threads ---------------------------------------------------------------

    def warm_up(self) -> int:
        """Record the engine's static passes before the first request (on a GPU: CUDA graphs);
        call before start(). -> sizes recorded."""
        return self.engine.warm_up()

    def calibrate(self) -> None:
        """Measure (or read from the disk cache) the curves the speculation policies read: the
        batch's pass costs (adaptive), the one-sequence forward times up to the longest verify a
        request may ask for (a request's cost policy, an automatic tree). Call before start()."""
        if self.spec_policy == "off":
            return
        engine = self.engine
        tree = AUTO_TREE_MAX if engine.spec.tree == AUTO_TREE else 0
        calibrated_curve(engine.target, max(MAX_K, tree) + 1)
        if engine.draft is not None:
            calibrated_curve(engine.draft, 1)
        self.session.calibrate()

    def start(self) -> None:
        self._thread.start()
        if self.distiller is not None:
            self.distiller.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        if self.distiller is not None:
            self.distiller.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            live, queued = self._counts
            return live, queued + len(self._waiting)

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of `jobs` (the n choices of one request) or none: Busy when they don't fit."""
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down (or its worker failed)")
            if sum(self._counts) + len(self._waiting) + len(jobs) > self.slots + self.max_queue:
                raise Busy(f"the server is at its limit ({self.slots} running + {self.max_queue} "
                           f"queued requests); retry later")
            self._waiting.extend(jobs)
            self._publish_load()
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job now if it waits, before the next pass if it is in
        the batch."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.finished.labels("cancelled").inc()
                self._publish_load()
                return
        job.cancelled.set()

    # --- the worker thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                try:
                    return self._serve()
                except Exception:
                    log.exception("the worker crashed; failing its running jobs")
                    self.restarts += 1
                    self._drop_running()
                    if self.restarts > MAX_RESTARTS:
                        log.error("the worker crashed %d times; it stops", self.restarts)
                        if self.on_fatal is not None:
                            self.on_fatal()
                        return
        except BaseException:
            log.exception("the worker stopped")  # /health says so, requests fail fast
            raise
        finally:
            with self._cond:  # tell whoever still listens; refuse new jobs from now on
                self._stopping = True
                left = [run.job for run in self._runs.values()] + list(self._waiting)
                self._runs.clear()
                self._waiting.clear()
            for job in left:
                self._emit(job, Failed(job.index, "the server is shutting down"))

    def _serve(self) -> None:
        """Join new jobs, drop the cancelled, run a pass; until stopped."""
        while True:
            with self._cond:
                if not (self._stopping or self._waiting or self._runs):
                    return_free_memory()  # idle: a burst's freed buffers go back to the OS
                while not (self._stopping or self._waiting or self._runs):
                    self._cond.wait()
                if self._stopping:
                    return
                new = list(self._waiting)
                self._waiting.clear()
                live, queued = self._counts
                self._counts = (live, queued + len(new))  # still in flight while they join
            for job in new:
                self._join(job)
            for run in [r for r in self._runs.values() if r.job.cancelled.is_set()]:
                self._finish(run, "cancelled")
            if self._runs:
                self._pass()
            with self._cond:
                self._publish_load()

    def _join(self, job: Job) -> None:
        spec = SpecConfig("none") if self.spec_policy == "off" else job.spec
        try:
            seq = self.session.sequence(job.ids, job.sampling, job.max_tokens, spec,
                                        job.logprobs, job.prompt_logprobs)
        except (ValueError, ModelError) as e:
            self.metrics.finished.labels("error").inc()
            return self._emit(job, Failed(job.index, short_error(e)))
        self.session.add(seq)
        self._runs[id(seq)] = Running(job, seq, TextOut(self.engine.tokenizer, job.stop), spec)
        self.metrics.prompt_tokens.inc(len(job.ids))

    def _pass(self) -> None:
        """One target pass over the batch; every request gets its new text."""
        for run in self._runs.values():
            run.seq.k_limit = k_cap(self.mode, run.spec.k)
        if self.distiller is not None:  # between passes: the newest trained head drafts
            self.distiller.swap()
        try:
            results = self.session.step()
        except Exception as e:  # the pass itself (a runtime failure): fail the requests in it
            log.exception("a batch pass failed")
            message = f"generation failed ({short_error(e)})"
            for run in [self._runs[id(seq)] for seq in self.session.drop_all()]:
                self._finish(run, "error", Failed(run.job.index, message))
            return
        self._observe_pass(results)
        self.metrics.preemptions.set(self.session.preempted)
        for seq, step in results:
            run = self._runs[id(seq)]
            if step is None:
                log.error("a request failed", exc_info=seq.error)
                self._finish(run, "error", Failed(run.job.index,
                                                  f"generation failed ({short_error(seq.error)})"))
            else:
                self._deliver(run, step)

    def _deliver(self, run: Running, step: Step) -> None:
        job = run.job
        text, hit = run.text.push(step.tokens, final=step.finish_reason is not None)
        if hit:  # a stop string: the request ends here, whatever its member would do next
            step = replace(step, finish_reason="stop")
        run.steps.append(step)
        run.tally.add(step)
        self._observe(run, step)
        self._emit(job, Delta(job.index, text, step.tokens, step, run.tally.to_dict()))
        if step.finish_reason is not None:
            spec = run.spec
            k = spec.k if spec.method != "none" else 0
            stats = GenerationStats.from_steps(spec.method, k, job.arrival, run.steps,
                                               spec.shadow)
            self._finish(run, step.finish_reason,
                         Done(job.index, step.finish_reason, stats, run.tally.new_tokens))

    def _drop_running(self) -> None:
        """After a crash: fail every job whose member was admitted (its state may be half
        updated) and free its cache; jobs still waiting for memory stay."""
        waiting = {id(seq) for seq in self.session.waiting}
        runs = [r for r in self._runs.values() if id(r.seq) not in waiting]
        for run in runs:
            self._finish(run, "error", Failed(run.job.index, CRASHED))
        with self._cond:
            self._publish_load()

    def _publish_load(self) -> None:
        """Queue gauges and the speculation mode for the current load (holding the lock)."""
        if threading.current_thread() is self._thread:
            self._counts = (len(self.session.live), len(self.session.waiting))
        running, queued = self._counts
        waiting = queued + len(self._waiting)
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting)
        mode = self.shedding.mode(running + waiting)
        if mode != self.mode:
            self.mode = mode
            self.metrics.set_mode(mode)

    def _observe_pass(self, results: list[tuple[Sequence, Step | None]]) -> None:
        """The pass's batch size, draft tokens and what speculation did in it."""
        steps = [(self._runs[id(s)], r) for s, r in results if r is not None and not r.prefill]
        drafted = sum(r.drafted for _, r in steps)
        wanted = sum(min(run.spec.k, run.seq.k_limit) for run, _ in steps
                     if run.seq.proposer is not None)
        self.metrics.observe_pass(self.session.pass_size, drafted, wanted)

    def _observe(self, run: Running, step: Step) -> None:
        m, n = self.metrics, len(step.tokens)
        m.observe_step(step.drafted, step.accepted, n, step.prefill, run.spec.shadow)
        if not n:
            return
        if run.last_token_time is None:
            m.ttft.observe(step.time - run.job.arrival)
        else:
            gap = (step.time - run.last_token_time) / n  # per token, as GenerationStats.itl_s
            for _ in range(n):
                m.itl.observe(gap)
        run.last_token_time = step.time

    def _finish(self, run: Running, reason: str, event: Event | None = None) -> None:
        """The job leaves: its member's cache is free before the next pass."""
        self.session.drop(run.seq)
        self._runs.pop(id(run.seq), None)
        if event is not None:
            self._emit(run.job, event)
        self.metrics.finished.labels(reason).inc()

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.emit(event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens any more
            job.cancelled.set()
        except Exception:  # a broken listener loses its job, not the worker
            log.exception("a job's listener failed")
            job.cancelled.set()
