"""The drafter worker of the asynchronous pipeline (`--disaggregate`) as a Ray actor, placed with
the target by a Ray placement group (`--disaggregate --ray`).

Owns: `DrafterActor` (the Ray actor: the unchanged worker loop,
`forerun.propose.drafter_worker.serve`, on a thread of its own, behind two mailboxes),
`ActorChannel` (the proposer's end: the same messages, carried by actor calls), `RayDrafter`
(what the proposer holds, as it holds a `DrafterProcess`), `DrafterPlacement` (the placement
group's bundles) and `start_ray_drafter`, which the Engine calls in place of
`forerun.propose.disaggregate.start_drafter`.

Placement. One placement group, two bundles: TARGET_BUNDLE `{CPU: target cores}` and
DRAFTER_BUNDLE `{CPU: draft cores}`; PACK (default) keeps both on one node, SPREAD puts the
drafter on another node where one has room. The target stays in the process that runs the
engine (the CLI's, or a Ray Serve replica's) rather than becoming an actor too: the decode loop,
the verifier, the stop strings and the text stream all live there, and a target actor would put
a Ray call in every verify pass to save nothing. Its bundle is reserved anyway, tied to this
node (Ray's `node:<ip>` resource), so nothing else Ray schedules takes its cores, and this
process's threads are pinned to the target's cores as the local pipeline pins them. Inside a
Ray Serve replica whose deployment reserved both bundles (`forerun serve --ray --disaggregate`:
`forerun.cluster.deploy`), the replica holds TARGET_BUNDLE and its drafter goes into
DRAFTER_BUNDLE of the replica's own group; no group is made.

Transport. `send` is a fire-and-forget `put` call, numbered (a threaded actor may run calls out
of order; the actor hands them to the loop in their numbers' order). The other way, one `fetch`
call is in flight at a time: a long poll that returns every message the loop has sent as soon as
there is one (at most LONG_POLL_S later when there is none), so the nodes of a draft arrive in
batches while the target verifies and `poll(0)` only looks at a finished call. A dead actor
(`ray.kill`, its node lost) fails the call in flight: `poll` then says a message is there and
`recv` raises EOFError, as a closed pipe does, and the proposer decodes on plainly.

Ray is imported inside the functions that need it: forerun imports without it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from forerun.propose.disaggregate import DisaggregateConfig
from forerun.propose.drafter_worker import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    DrafterGone,
    Failed,
    Ready,
    Shutdown,
    serve,
)
from forerun.runtime.base import Runtime

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement strategies
TARGET_BUNDLE, DRAFTER_BUNDLE = 0, 1  # a Ray Serve replica runs in its group's first bundle
LONG_POLL_S = 0.5  # the most a fetch call waits in the actor for a message
PLACEMENT_TIMEOUT_S = 60.0  # the most we wait for the cluster to reserve the bundles
NODE_SHARE = 0.001  # of the `node:<ip>` resource: ties the target's bundle to this node
ACTOR_CALLS = 4  # concurrent calls the actor takes (a long poll beside the puts)
OBJECT_STORE_BYTES = 128 << 20  # a local cluster's object store: the messages are small
ENDED = "ended"  # in a fetch's answer: the loop has returned, nothing more will come


@dataclass(frozen=True)
class DrafterPlacement:
    """The placement group of one drafter and its target."""

    draft_cores: int
    target_cores: int
    strategy: str = "PACK"

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {', '.join(STRATEGIES)}, got "
                             f"{self.strategy!r}")
        if self.draft_cores < 1 or self.target_cores < 1:
            raise ValueError(f"need draft and target cores >= 1, got {self.draft_cores} and "
                             f"{self.target_cores}")

    def bundles(self, node: str | None = None) -> list[dict[str, float]]:
        """[target's, drafter's]; `node`: an IP the target's bundle is tied to."""
        target = {"CPU": float(self.target_cores)}
        if node is not None:
            target[f"node:{node}"] = NODE_SHARE
        return [target, {"CPU": float(self.draft_cores)}]


class _Mailboxes:
    """The loop's end inside the actor: a Channel over two thread-safe queues."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.held: deque = deque()  # taken off the inbox by poll, not yet received
        self.outbox: list = []
        self.changed = threading.Condition()
        self.ended = False

    def send(self, obj: Any) -> None:
        with self.changed:
            self.outbox.append(obj)
            self.changed.notify_all()

    def poll(self, timeout: float | None = 0.0) -> bool:
        if not self.held:
            with contextlib.suppress(queue.Empty):
                self.held.append(self.inbox.get(timeout=timeout) if timeout != 0
                                 else self.inbox.get_nowait())
        return bool(self.held)

    def recv(self) -> Any:
        return self.held.popleft() if self.held else self.inbox.get()

    def end(self) -> None:
        with self.changed:
            self.ended = True
            self.changed.notify_all()


class DrafterActor:
    """The Ray actor: `serve` on a thread, fed by `put`, read by `fetch`. `cores`: the CPUs
    it pins the loop to (None: the last `threads` of its own)."""

    def __init__(self, build: Callable[[], Runtime], vocab_size: int,
                 cores: tuple[int, ...] | None, threads: int):
        self.box = _Mailboxes()
        self.next_put, self.early = 0, {}
        self.order = threading.Lock()
        cores = cores or tuple(sorted(os.sched_getaffinity(0))[-threads:])
        self.thread = threading.Thread(target=self._loop, args=(build, vocab_size, cores),
                                       daemon=True, name="forerun-drafter")
        self.thread.start()

    def _loop(self, build, vocab_size: int, cores: tuple[int, ...]) -> None:
        try:
            serve(self.box, build, vocab_size, cores)  # pins this thread (its pool inherits)
        finally:
            self.box.end()

    def put(self, number: int, messages: list) -> None:
        """Messages for the loop, in the order of their numbers whatever order calls run in."""
        with self.order:
            self.early[number] = messages
            while self.next_put in self.early:
                for msg in self.early.pop(self.next_put):
                    self.box.inbox.put(msg)
                self.next_put += 1

    def fetch(self, wait_s: float) -> list:
        """Every message the loop has sent, once there is one (or wait_s has passed); ENDED
        last once the loop has returned."""
        box = self.box
        with box.changed:
            box.changed.wait_for(lambda: box.outbox or box.ended, wait_s)
            out, box.outbox = box.outbox, []
            return out or ([ENDED] if box.ended else [])


class ActorChannel:
    """The proposer's end of a `DrafterActor`: a Channel (send, poll, recv)."""

    def __init__(self, actor):
        self.actor = actor
        self.sent = 0  # numbered puts
        self.inbox: deque = deque()
        self.pending = None  # the fetch call in flight
        self.ended = False
        self.why: str | None = None  # why the actor is gone (its error)

    def send(self, obj: Any) -> None:
        if self.ended:
            raise BrokenPipeError(f"the drafter actor is gone ({self.why or 'closed'})")
        self.actor.put.remote(self.sent, [obj])
        self.sent += 1

    def poll(self, timeout: float | None = 0.0) -> bool:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.inbox and not self.ended:
            if self.pending is None:
                self.pending = self.actor.fetch.remote(LONG_POLL_S)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait([self.pending], timeout=left)
            if done:
                self._take(ray)
            elif deadline is not None:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                break
        return bool(self.inbox) or self.ended

    def _take(self, ray) -> None:
        ref, self.pending = self.pending, None
        try:
            messages = ray.get(ref)
        except ray.exceptions.RayError as e:  # killed, crashed, its node lost
            self.ended, self.why = True, type(e).__name__
            return
        if messages and messages[-1] == ENDED:
            self.ended, self.why = True, "its loop returned"
            messages = messages[:-1]
        self.inbox.extend(messages)

    def recv(self) -> Any:
        while not self.inbox and not self.ended:
            self.poll(None)
        if self.inbox:
            return self.inbox.popleft()
        raise EOFError(f"the drafter actor is gone ({self.why})")


class RayDrafter:
    """A drafter worker as a Ray actor in bundle `bundle` of `group`: what the proposer holds
    (the `DrafterProcess` interface: channel, alive, new_session, close)."""

    def __init__(self, build: Callable[[], Runtime], vocab_size: int, group, bundle: int,
                 cores: tuple[int, ...] | None, threads: int, owns_group: bool,
                 start_timeout: float = START_TIMEOUT_S):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.group, self.owns_group, self.cores = group, owns_group, cores
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        self.actor = ray.remote(DrafterActor).options(
            num_cpus=threads, max_concurrency=ACTOR_CALLS, max_restarts=0,
            scheduling_strategy=strategy).remote(build, vocab_size, cores, threads)
        self.channel = ActorChannel(self.actor)
        self.sessions = 0
        if not self.channel.poll(start_timeout):
            self.close()
            raise DrafterGone(f"the drafter actor did not start in {start_timeout:.0f} s")
        try:
            msg = self.channel.recv()
        except EOFError as e:
            msg = Failed(f"the drafter actor exited at start: {e}")
        if not isinstance(msg, Ready):
            self.close()
            raise DrafterGone(msg.message if isinstance(msg, Failed) else f"unexpected {msg!r}")
        self.pid = msg.pid

    def new_session(self) -> int:
        self.sessions += 1
        return self.sessions

    @property
    def alive(self) -> bool:
        return not self.channel.ended

    def close(self) -> None:
        """Ask the loop to return, then end the actor, and the group where it made one."""
        import ray

        if not self.channel.ended:
            with contextlib.suppress(OSError):
                self.channel.send(Shutdown())
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while not self.channel.ended and time.monotonic() < deadline:
                self.channel.poll(deadline - time.monotonic())
                self.channel.inbox.clear()
        with contextlib.suppress(Exception):
            ray.kill(self.actor)
        if self.owns_group:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(self.group)
            self.owns_group = False


def join_cluster(address: str | None, cpus: int) -> None:
    """Connect to the Ray cluster at `address`, or start a local one of `cpus` CPUs (stopped
    when this process exits); nothing where this process is connected already."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("--disaggregate --ray needs Ray: pip install 'forerun[cluster]'") \
            from e
    if ray.is_initialized():
        return
    if address is not None:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                 object_store_memory=OBJECT_STORE_BYTES)


def reserve(placement: DrafterPlacement, timeout: float = PLACEMENT_TIMEOUT_S):
    """The placement group of `placement`, ready; its target bundle tied to this node where
    this process runs on one of the cluster's nodes."""
    import ray
    from ray.util.placement_group import placement_group

    node = ray.util.get_node_ip_address()
    on_node = f"node:{node}" in ray.cluster_resources()
    group = placement_group(placement.bundles(node if on_node else None),
                            strategy=placement.strategy, name="")
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise DrafterGone(f"the Ray cluster did not reserve {placement.bundles()} "
                          f"({placement.strategy}) in {timeout:.0f} s") from None
    return group


def bundle_node(group, bundle: int) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table(group)["bundles_to_node_id"][bundle]


def start_ray_drafter(build: Callable[[], Runtime], vocab_size: int, cfg: DisaggregateConfig,
                      strategy: str, available: set[int], address: str | None = None
                      ) -> tuple[RayDrafter, tuple[int, ...]]:
    """The drafter started as a Ray actor in its bundle -> it, and the cores left to the target
    (this process). Joins (or starts) a cluster if this process has none."""
    import ray
    from ray.util import get_current_placement_group

    draft, target = cfg.placement(available)
    placement = DrafterPlacement(len(draft), len(target), strategy)
    join_cluster(address, len(draft) + len(target))
    group = get_current_placement_group()  # a Serve replica's own, holding a drafter bundle
    owns = group is None or len(group.bundle_specs) <= DRAFTER_BUNDLE
    if owns:
        group = reserve(placement)
    here = bundle_node(group, DRAFTER_BUNDLE) == ray.get_runtime_context().get_node_id()
    try:
        drafter = RayDrafter(build, vocab_size, group, DRAFTER_BUNDLE, draft if here else None,
                             len(draft), owns)
    except BaseException:
        if owns:
            ray.util.remove_placement_group(group)
        raise
    return drafter, target

