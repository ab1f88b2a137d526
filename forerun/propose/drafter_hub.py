"""The proposer side of one drafter worker's channel: what arrives, sorted by sequence.

Owns: `DrafterHub`. One worker drafts for many sequences (a batch's members, or one sequence
after another), each the proposer of one `session`; they share the worker's one channel. The
hub sends for all of them and reads for all of them: every message that arrives goes to its
session's inbox (a session no longer open: dropped, it was drafted for a sequence that left),
and a worker that fails or dies fails every session at once (`DrafterGone`), so each member
decodes on plainly and nothing waits on it. It also opens the worker's pool (`Pool`) the first
time a batch asks. Knows nothing of trees or tokens: `forerun.propose.disaggregate` reads the
inboxes.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from forerun.propose.drafter_messages import (
    Channel,
    Drafted,
    DrafterGone,
    Dropped,
    Failed,
    Pool,
    Rooted,
)


class Worker(Protocol):
    """What the hub needs of a drafter worker (a DrafterProcess, or another transport's)."""

    channel: Channel

    @property
    def alive(self) -> bool: ...

    def new_session(self) -> int: ...


class DrafterHub:
    """The worker's channel, shared by the proposers of every session it drafts for."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.inboxes: dict[int, deque] = {}  # session -> its messages not yet read
        self.failure: str | None = None  # why the worker drafts for nobody any more
        self.pool_tokens = 0  # the pool the worker was asked for (0: one sequence at a time)

    def open(self) -> int:
        """A new session (a sequence number no earlier one of this worker used) and its inbox."""
        session = self.worker.new_session()
        self.inboxes[session] = deque()
        return session

    def close(self, session: int) -> None:
        """Forget the session: what still arrives for it is dropped."""
        self.inboxes.pop(session, None)

    def open_pool(self, tokens: int) -> None:
        """Ask the worker to draft for many sequences at once, from a pool of `tokens` slots
        (the first batch's size holds: the worker builds its pool once)."""
        if not self.pool_tokens:
            self.send(Pool(tokens))
            self.pool_tokens = tokens

    def send(self, msg: Any) -> None:
        self._check()
        try:
            self.worker.channel.send(msg)
        except OSError as e:  # the worker's end is closed: it died
            self._gone(f"the drafter worker is gone ({type(e).__name__})")

    def pump(self, timeout: float = 0.0) -> bool:
        """Sort every message that has arrived (waiting up to `timeout` for the first) into
        its session's inbox -> whether any arrived. DrafterGone once the worker is."""
        self._check()
        channel, arrived = self.worker.channel, False
        try:
            if timeout > 0 and not channel.poll(timeout):
                if not self.worker.alive:
                    self._gone("the drafter worker exited")
                return False
            while channel.poll(0):
                msg = channel.recv()
                arrived = True
                if isinstance(msg, Failed):
                    self._gone(msg.message)
                if isinstance(msg, Drafted | Rooted | Dropped) and msg.session in self.inboxes:
                    self.inboxes[msg.session].append(msg)
        except (EOFError, OSError) as e:
            self._gone(f"the drafter worker is gone ({type(e).__name__})")
        return arrived

    def take(self, session: int) -> list[Any]:
        """The session's messages that arrived, in order (its inbox emptied)."""
        box = self.inboxes.get(session)
        if not box:
            return []
        out = list(box)
        box.clear()
        return out

    def _check(self) -> None:
        if self.failure is not None:
            raise DrafterGone(self.failure)

    def _gone(self, why: str) -> None:
        self.failure = why
        raise DrafterGone(why)
