"""The model-owning worker: one thread, a FIFO of jobs, and a step-level round robin over slots.

Owns: the only code that touches the models, the queue of waiting jobs, and the choice of how
much to speculate under load. HTTP handlers call `submit` and `cancel` from the event loop;
everything else runs on the worker thread. A job's results go back through its `emit` callback
(which must be thread-safe) as `Delta` events, then one `Done` or `Failed`.

Scheduling. The worker holds `slots` engines: forks of one engine, sharing the weights, each with
KV caches of its own. A job waits in the FIFO until a slot is free; then, round after round,
every running job advances by one step (one target forward pass: the prefill, or a draft +
verify step), in admission order. This is fair interleaving, not batching: a round costs the sum
of its jobs' steps, and each job's tokens are exactly those it would get alone.

Speculation under load. `LoadShedding` maps the number of jobs in flight (running + waiting) to a
mode: full (each job's own k), reduced (at most half of it) or off (plain steps), read before
every step, so a long generation follows the load as it changes.

Cancellation. `cancel` drops a waiting job at once; a running job is dropped before its next
step, which frees its slot for the next waiting job.

Failures. A job whose generation raises fails alone (`Failed`, a short message; the traceback
goes to the log). A crash of the scheduling itself (a bug) fails the jobs running at that
moment, frees their slots and restarts the loop; after MAX_RESTARTS such crashes the worker
stops for good and calls `on_fatal` (the serve command then exits non-zero, for a supervisor).

Calibration. The cost policy and an automatic tree budget price drafts with forward-time curves
measured at a runtime's first use (`forerun.profile`); `calibrate` measures them before serving,
so that no request's first step stalls every slot while one runtime is timed.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from forerun.api import Chunk, Engine
from forerun.metrics import GenerationStats, Step
from forerun.profile import calibrated_curve, share_curve
from forerun.propose import SpecConfig
from forerun.propose.heads import AUTO_TREE, AUTO_TREE_MAX
from forerun.sampling import SamplingConfig
from forerun.serve.limits import MAX_ERROR_CHARS, MAX_K, MAX_RESTARTS
from forerun.serve.metrics import ServerMetrics

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
    job: Job
    engine: Engine
    chunks: Generator[Chunk, None, None]
    steps: list[Step] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)
    last_token_time: float | None = None


class Busy(Exception):
    """Every slot is taken and the queue is full."""


class Stopped(Exception):
    """The worker has stopped: no new jobs."""


class Worker:
    def __init__(self, engine: Engine, *, slots: int, max_queue: int,
                 shedding: LoadShedding | None = None, metrics: ServerMetrics | None = None,
                 on_fatal: Callable[[], None] | None = None):
        if slots < 1 or max_queue < 0:
            raise ValueError(f"need slots >= 1 and max_queue >= 0, got {slots} and {max_queue}")
        self.engine, self.slots, self.max_queue = engine, slots, max_queue
        self.shedding = shedding or LoadShedding()
        self.metrics = metrics or ServerMetrics()
        self._free = [engine] + [engine.fork() for _ in range(slots - 1)]
        self._waiting: deque[Job] = deque()
        self._running: list[Running] = []
        self._cond = threading.Condition()
        self._stopping = False
        self.restarts = 0  # crashes of the loop recovered from
        self.on_fatal = on_fatal  # called from the worker thread when it stops for good
        self.mode = "full"
        self.metrics.slots.set(slots)
        self.metrics.set_mode(self.mode)
        self._thread = threading.Thread(target=self._loop, name="forerun-worker", daemon=True)

    # --- called from other threads ---------------------------------------------------------------

    def warm_up(self) -> int:
        """Every slot's engine records its static passes before the first request (on a GPU:
        CUDA graphs, each slot its own); call before start(). -> sizes recorded."""
        return sum(engine.warm_up() for engine in self._free)

    def calibrate(self) -> None:
        """Measure (or read from the disk cache) the forward-time curves a cost policy or an
        automatic tree reads, for one slot, up to the longest verify a request may ask for; the
        other slots share them (same weights, same speed). Call before start()."""
        first = self._free[0]
        tree = AUTO_TREE_MAX if first.spec.tree == AUTO_TREE else 0
        calibrated_curve(first.target, max(MAX_K, tree) + 1)
        if first.draft is not None:
            calibrated_curve(first.draft, 1)
        for engine in self._free[1:]:
            share_curve(engine.target, first.target)
            if engine.draft is not None:
                share_curve(engine.draft, first.draft)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def in_flight(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def submit(self, jobs: list[Job]) -> None:
        """Queue all of `jobs` (the n choices of one request) or none: Busy when they don't fit."""
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down (or its worker failed)")
            taken = len(self._running) + len(self._waiting)
            if taken + len(jobs) > self.slots + self.max_queue:
                raise Busy(f"the server is at its limit ({self.slots} running + {self.max_queue} "
                           f"queued requests); retry later")
            self._waiting.extend(jobs)
            self._publish_load()
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job now if it waits, before its next step if it runs."""
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
                left = [run.job for run in self._running] + list(self._waiting)
            for job in left:
                self._emit(job, Failed(job.index, "the server is shutting down"))

    def _serve(self) -> None:
        """Admit and step jobs, round after round, until stopped."""
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running):
                    self._cond.wait()
                if self._stopping:
                    return
                self._admit()
                round_ = list(self._running)
            for run in round_:
                self._step(run)

    def _drop_running(self) -> None:
        """After a crash: fail every running job and take its slot back; waiting jobs stay."""
        with self._cond:
            runs, self._running = self._running, []
            self._free.extend(run.engine for run in runs)
            self._publish_load()
        for run in runs:
            try:
                run.chunks.close()
            except Exception:
                log.exception("closing a crashed generation")
            self.metrics.finished.labels("error").inc()
            self._emit(run.job, Failed(run.job.index, CRASHED))

    def _admit(self) -> None:
        """Move waiting jobs into free slots (holding the lock)."""
        while self._waiting and self._free:
            job, engine = self._waiting.popleft(), self._free.pop()
            chunks = engine.stream(job.ids, sampling=job.sampling, max_tokens=job.max_tokens,
                                   stop=job.stop, spec=job.spec,
                                   k_cap=lambda k=job.spec.k: k_cap(self.mode, k))
            self._running.append(Running(job, engine, chunks))
            self.metrics.prompt_tokens.inc(len(job.ids))
        self._publish_load()

    def _publish_load(self) -> None:
        """Queue gauges and the speculation mode for the current load (holding the lock)."""
        running, waiting = len(self._running), len(self._waiting)
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(waiting)
        mode = self.shedding.mode(running + waiting)
        if mode != self.mode:
            self.mode = mode
            self.metrics.set_mode(mode)

    def _step(self, run: Running) -> None:
        job = run.job
        if job.cancelled.is_set():
            return self._finish(run, "cancelled")
        try:
            chunk = next(run.chunks)
        except StopIteration:  # cannot happen: the last chunk carries a finish reason
            return self._finish(run, "error", Failed(job.index, "generation ended early"))
        except Exception as e:  # a bug or a runtime failure: fail this job, keep serving
            log.exception("generation failed")
            return self._finish(run, "error", Failed(job.index,
                                                     f"generation failed ({short_error(e)})"))
        step = chunk.step
        run.steps.append(step)
        run.tally.add(step)
        self._observe(run, step)
        self._emit(job, Delta(job.index, chunk.text, chunk.token_ids, step, run.tally.to_dict()))
        if step.finish_reason is not None:
            spec = job.spec
            k = spec.k if spec.method != "none" else 0
            stats = GenerationStats.from_steps(spec.method, k, job.arrival, run.steps)
            self._finish(run, step.finish_reason,
                         Done(job.index, step.finish_reason, stats, run.tally.new_tokens))

    def _observe(self, run: Running, step: Step) -> None:
        m, n = self.metrics, len(step.tokens)
        m.observe_step(step.drafted, step.accepted, n, step.prefill)
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
        run.chunks.close()
        if event is not None:
            self._emit(run.job, event)
        self.metrics.finished.labels(reason).inc()
        with self._cond:
            self._running.remove(run)
            self._free.append(run.engine)
            self._publish_load()

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.emit(event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens any more
            job.cancelled.set()
        except Exception:  # a broken listener loses its job, not the worker
            log.exception("a job's listener failed")
            job.cancelled.set()
