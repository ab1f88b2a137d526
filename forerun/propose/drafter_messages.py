"""The messages between the drafter worker of `--disaggregate` and the proposers it drafts for,
and the small pure helpers both of its loops share.

Owns: the protocol. Proposer -> worker: `Prefill` (a new sequence and, in a pool, the slots its
draft region may take), `Begin`, `Verdict`, `Rest`, `Pool`, `Shutdown`; worker -> proposer:
`Ready`, `Drafted`, `Rooted`, `Dropped` (one sequence the worker cannot draft for), `Failed`
(the worker itself). Every message about a sequence carries its `session` number, unique per
worker, so one channel carries many sequences: a pool worker
(`forerun.propose.drafter_pool`) keeps a tree and a draft cache region per session and the
proposer side routes what arrives by session (`forerun.propose.drafter_hub`). A `Channel` is
anything with `send`, `poll` and `recv` of picklable objects (a multiprocessing Connection, a
Ray actor's queue): nothing here knows what sits at either end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from forerun.sampling import SamplingConfig

FIRST_ROOT = -1  # the root's id after Begin; the n-th verdict's fresh root is FIRST_ROOT - n
EVERY_SESSION = -1  # Rest's session where it means whichever the one-sequence worker drafts


# proposer -> worker
@dataclass(frozen=True)
class Prefill:
    session: int  # the sequence's number (messages about an older one are dropped)
    prompt: list[int]
    slots: int = 0  # in a pool: the most tokens its draft region holds (0: the context)


@dataclass(frozen=True)
class Begin:
    session: int
    tokens: list[int]  # the sequence so far: the prompt and the prefill's token (the root)
    sampling: SamplingConfig
    seed: int  # of the worker's own generator (its draws are never the verifier's)
    ahead: int  # the most nodes drafted past the root
    lookup: int = 0  # greedy: prompt-lookup guesses the draft model checks in a pass (0: off)


@dataclass(frozen=True)
class Verdict:
    session: int
    tokens: list[int]  # committed behind the root: the accepted path, then bonus or recovered


@dataclass(frozen=True)
class Rest:
    """Stop drafting for the sequence (it ended): in a pool its region is freed; the
    one-sequence worker's core goes idle."""

    session: int = EVERY_SESSION


@dataclass(frozen=True)
class Pool:
    """From now on draft for many sequences at once: a draft cache pool of as many tokens as
    the batch's target pool (`tokens`), a region per sequence, one draft pass for all of them
    (`forerun.propose.drafter_pool`). Sent once, before a batch's first Prefill."""

    tokens: int


@dataclass(frozen=True)
class Shutdown:
    pass


# worker -> proposer
@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Drafted:
    session: int
    node: int  # its id, global and fixed (see forerun.propose.reroot)
    parent: int
    token: int
    q: Any = None  # [V] numpy array: the distribution it was drawn from; None = greedy


@dataclass(frozen=True)
class Rooted:
    session: int
    verdict: int  # the session's verdicts so far (this one included)
    root: int  # the root's id after it


@dataclass(frozen=True)
class Dropped:
    """The worker drafts nothing for this session (its pool had no room): it decodes plainly."""

    session: int
    message: str


@dataclass(frozen=True)
class Failed:
    message: str


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def recv(self) -> Any: ...


class DrafterGone(RuntimeError):
    """The worker died, failed, or closed its end (or dropped this sequence)."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def to_host(q: torch.Tensor):
    """q [V] as a numpy array, exactly (a half type widened to float32: no rounding)."""
    if q.dtype in (torch.bfloat16, torch.float16):
        q = q.float()
    return q.cpu().numpy()


def to_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """The draft's logits [V_draft] padded or cut to the target's vocabulary (one tokenizer)."""
    if logits.shape[-1] >= size:
        return logits[:size]
    return torch.cat([logits, logits.new_full((size - logits.shape[-1],), float("-inf"))])
