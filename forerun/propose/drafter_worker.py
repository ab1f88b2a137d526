"""The drafter worker of the asynchronous pipeline: a draft model in a process of its own,
drafting ahead while the target verifies, and the message protocol between the two.

Owns: the worker's one-sequence loop (`serve`), and `DrafterProcess`, which starts it on its
own cores and hands back its `Channel`. The messages (`Prefill`, `Begin`, `Verdict`, `Rest`,
`Pool`, `Shutdown` one way; `Ready`, `Drafted`, `Rooted`, `Dropped`, `Failed` the other) are
`forerun.propose.drafter_messages`'s, re-exported here. A Channel is anything with `send`,
`poll` and `recv` of picklable objects (a multiprocessing Connection here; a Ray actor's queue
could carry the same messages), so nothing here knows what sits at the other end. A `Pool`
message turns the worker into a batch's drafter for good (`forerun.propose.drafter_pool`: a
region per sequence, one draft pass for all of them).

The loop: after `Begin` (the sequence so far, its sampling settings and a seed), the worker
keeps extending the first-drafted line of its `AheadTree` (forerun.propose.reroot) one token a
draft-model pass, sending each node as a `Drafted` message the moment it exists, until the line
is `ahead` nodes past the root; between passes it reads what came in. A `Verdict` (the tokens
committed behind the root: the accepted path and the bonus or recovered token) re-roots the
tree exactly as the proposer re-roots its mirror; the line goes on where it was when the
verdict kept its subtree (nothing to undo in the cache), else the cache is cut back to what
the new sequence shares with it and drafting starts again from the new root. The worker
answers each verdict with `Rooted`: every node sent before it was drafted in the old frame,
every node after it in the new one, so the proposer re-roots its mirror at that point in the
stream and the two trees stay the same tree (until then it drafts from a tentative re-rooting
of what it has, which the worker's own, holding those nodes too, agrees with).

Cache invariant: the draft runtime's cache holds `cached`, a prefix of `line` (the committed
sequence, then the tokens along the tree's first-drafted line); a pass feeds the rest of `line`
and drafts one token after it. Knows nothing of text, nor of the target.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable

import torch

from forerun.processors import process_row
from forerun.propose.drafter_messages import (
    FIRST_ROOT,
    Begin,
    Channel,
    Drafted,
    DrafterGone,
    Dropped,
    Failed,
    Pool,
    Prefill,
    Ready,
    Rest,
    Rooted,
    Shutdown,
    Verdict,
    common_prefix,
    to_host,
    to_vocab,
)
from forerun.propose.drafter_pool import serve_pool
from forerun.propose.ngram import SuffixIndex
from forerun.propose.reroot import AheadNode, AheadTree
from forerun.runtime.base import Runtime
from forerun.sampling import logits_to_probs, make_generator, sample

__all__ = ["FIRST_ROOT", "Begin", "Channel", "Drafted", "DrafterGone", "DrafterProcess", "Dropped",
           "Failed", "Pool", "Prefill", "Ready", "Rest", "Rooted", "Shutdown", "Verdict", "pin",
           "serve"]

START_TIMEOUT_S = 600.0  # the most a worker may take to load its draft model and say Ready
STOP_TIMEOUT_S = 5.0  # the most a worker is given to exit after Shutdown before it is killed
LOOKUP_MIN_N, LOOKUP_MAX_N = 2, 4  # the suffix lengths a lookup guess matches


def pin(cores: tuple[int, ...] | None) -> None:
    """Run this process on `cores` with one compute thread per core (None: as it is)."""
    if not cores:
        return
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


class _Session:
    """The sequence being drafted, and the worker's tree and cache for it."""

    def __init__(self, runtime: Runtime, vocab_size: int, msg: Begin, prompt_length: int):
        self.runtime, self.vocab_size, self.session = runtime, vocab_size, msg.session
        self.sampling, self.ahead, self.prompt_length = msg.sampling, msg.ahead, prompt_length
        self.generator = make_generator(msg.seed)
        self.committed = list(msg.tokens)  # the sequence, its last token the root
        self.tree = AheadTree(FIRST_ROOT)
        self.verdicts, self.next_id = 0, 0
        self.lookup = msg.lookup if msg.sampling.greedy and not msg.sampling.processing.active \
            else 0  # (its chains are the draft model's greedy ones: nothing to sample)
        self.index = SuffixIndex(LOOKUP_MIN_N, LOOKUP_MAX_N)

    def room(self) -> int:
        """Nodes it may still draft: up to `ahead` past the root, within the cache."""
        depth = len(self.tree.tip()[1])
        return min(self.ahead - depth, self.runtime.capacity - len(self.committed) - depth)

    def verdict(self, tokens: list[int]) -> None:
        self.verdicts += 1
        self.tree = self.tree.reroot(tokens, FIRST_ROOT - self.verdicts)
        self.committed.extend(tokens)

    def draft(self, cached: list[int]) -> tuple[list[Drafted], list[int]]:
        """One draft-model pass: the token(s) after the first-drafted line -> their messages,
        and the tokens the cache holds after it. `cached`: those it holds before. With
        `lookup`, the pass also checks up to that many tokens prompt lookup guesses come next
        (as speculative decoding checks a draft): each guess its argmax agrees with is a
        draft token this pass makes too, so copied text drafts several tokens a pass."""
        tip, path = self.tree.tip()
        line = [*self.committed, *path]
        same = common_prefix(cached, line)
        if same < len(cached):  # the verdict dropped what the cache was built on
            self.runtime.truncate(same)
        room = self.room() - 1  # beyond the token this pass drafts anyway
        guesses = self.index.match(line, min(self.lookup, room))[0] if self.lookup else []
        feed = torch.tensor(line[same:] + guesses, dtype=torch.long)  # [M + G], M >= 1
        rows = self.runtime.forward(feed, last_only=not guesses).logits[-len(guesses) - 1:]
        made: list[Drafted] = []
        for j in range(len(guesses) + 1):
            token, q = self._pick(to_vocab(rows[j], self.vocab_size), line)  # rows: [G+1, V]
            node, self.next_id = self.next_id, self.next_id + 1
            self.tree.add(node, AheadNode(tip, token, q))
            made.append(Drafted(self.session, node, tip, token, None if q is None else to_host(q)))
            tip = node
            if j == len(guesses) or guesses[j] != token:
                break
        if guesses:  # the cache keeps the guesses its argmax agreed with
            self.runtime.truncate(len(line) + len(made) - 1)
        return made, line + guesses[:len(made) - 1]

    def _pick(self, logits: torch.Tensor, line: list[int]) -> tuple[int, torch.Tensor | None]:
        """The draft token after `line` from its logits [V] -> it, and q where sampled."""
        if self.sampling.processing.active:  # q shaped as the target's p is
            logits = process_row(logits, self.sampling.processing, line, self.prompt_length)
        if self.sampling.greedy:
            return int(logits.argmax(-1)), None
        probs = logits_to_probs(logits, self.sampling)  # [V]
        return int(sample(probs, self.generator)), probs


def serve(channel: Channel, build: Callable[[], Runtime], vocab_size: int,
          cores: tuple[int, ...] | None) -> None:
    """The worker's loop: draft while there is room ahead and no message waits; block on the
    channel otherwise. Ends on Shutdown, or when the other end is gone."""
    pin(cores)
    try:
        runtime = build()
    except Exception as e:  # a clear message for the proposer, not a silent exit
        channel.send(Failed(f"the drafter could not load its model: {e}"))
        return
    channel.send(Ready(os.getpid()))
    session: _Session | None = None
    prompt: list[int] = []
    cached: list[int] = []  # what the draft cache holds
    current = -1  # the latest session Prefill named
    try:
        while True:
            if session is not None and session.room() > 0 and not channel.poll(0):
                drafted, cached = session.draft(cached)
                for msg in drafted:
                    channel.send(msg)
                continue
            msg = channel.recv()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Pool):  # a batch: from now on many sequences, one pass for all
                serve_pool(channel, runtime, vocab_size, msg)
                return
            if isinstance(msg, Rest):
                session = None
            if isinstance(msg, Prefill):
                current, prompt, session = msg.session, msg.prompt, None
                runtime.truncate(0)
                cached = []
                if len(prompt) > 1:  # the prompt but its last token, as the sync drafter
                    runtime.forward(torch.tensor(prompt[:-1]), last_only=True)
                    cached = list(prompt[:-1])
            elif isinstance(msg, Begin) and msg.session == current:
                session = _Session(runtime, vocab_size, msg, len(prompt))
            elif isinstance(msg, Verdict) and session is not None and \
                    msg.session == session.session:
                session.verdict(msg.tokens)
                channel.send(Rooted(session.session, session.verdicts, session.tree.root))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the proposer's end is gone: nothing left to draft for
    except Exception as e:
        with contextlib.suppress(OSError):
            channel.send(Failed(f"the drafter failed: {type(e).__name__}: {e}"))


def _main(conn, build: Callable[[], Runtime], vocab_size: int,
          cores: tuple[int, ...] | None) -> None:
    serve(conn, build, vocab_size, cores)
    conn.close()


class DrafterProcess:
    """A drafter worker in a spawned process pinned to `cores`; `build` (picklable: it runs in
    the new process) makes its draft runtime there."""

    def __init__(self, build: Callable[[], Runtime], vocab_size: int,
                 cores: tuple[int, ...] | None = None, start_timeout: float = START_TIMEOUT_S):
        ctx = multiprocessing.get_context("spawn")
        self.channel, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_main, args=(child, build, vocab_size, cores),
                                   daemon=True, name="forerun-drafter")
        self.process.start()
        child.close()  # only the worker holds its end: its death reads as EOF here
        self.cores = cores
        if not self.channel.poll(start_timeout):
            self.close()
            raise DrafterGone(f"the drafter worker did not start in {start_timeout:.0f} s")
        try:
            msg = self.channel.recv()
        except EOFError:
            msg = Failed(f"the drafter worker exited at start (code {self.process.exitcode})")
        if not isinstance(msg, Ready):
            self.close()
            raise DrafterGone(msg.message if isinstance(msg, Failed) else f"unexpected {msg!r}")
        self.pid = msg.pid
        self.sessions = 0

    def new_session(self) -> int:
        """A sequence number no earlier proposer of this worker used (its stale messages, still
        in the pipe, are told apart by it)."""
        self.sessions += 1
        return self.sessions

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.channel.send(Shutdown())
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.channel.close()
