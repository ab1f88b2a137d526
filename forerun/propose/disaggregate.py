"""Asynchronous (SwiftSpec-style) draft/target pipeline: the draft model drafts in a worker
process on cores of its own while the target verifies, and this proposer hands the target
whatever is drafted when it asks (`--disaggregate`).

Owns: `DisaggregateConfig` (placement and waiting), `DraftRecipe` (how the worker loads the
draft model in its own process), `AsyncDraftProposer` (the Proposer the engine sees: the same
verifier, the same step), `AsyncDraftBatch` (a batch's members drafted by one worker) and
`start_drafter`.

One step, as the target sees it:
  1. propose   send the verdict of the previous pass (the tokens committed behind the old
               root: accepted path, then bonus or recovered token) and re-root the mirror of
               the worker's tree exactly as the worker re-roots its own
               (`forerun.propose.reroot`); read every node that has arrived; take up to k of
               them. A pass never waits when a node under the root is ready; when none is
               (after a rejection the worker starts again from the new root), it waits at
               most `wait_s` for the first, then runs a plain one-row pass
  2. verify    the target's pass over the draft, the engine's own verifier, with the q each
               node was drawn from (they travel with the tokens: rejection sampling is exact)
Meanwhile the worker drafts on past what the target took, assuming it all accepted and its own
next token the bonus; a verdict that takes another branch drops those nodes. Why what survives
is still an exact draft: forerun.propose.reroot.

Sampling stays exact, but a seed no longer reproduces a run: which nodes are ready when the
target asks depends on timing. The drafter draws with its own generator (seeded from the
sequence's). A worker that dies, fails or closes mid-request leaves the request decoding on
plainly (its drafts empty), with `failure` saying why; nothing waits on it longer than
`wait_s`.

A batch: one worker drafts for every member (`AsyncDraftBatch`, the members' `group`). The
batch opens the worker's pool (`forerun.propose.drafter_pool`: a draft region per member, one
draft pass drafting one token for each); every member's proposer is a session of the worker's
one channel (`forerun.propose.drafter_hub` sorts what arrives), mirrors its own tree as above,
and takes at each pass what is ready for it; the pass waits at most `wait_s` in all, and a
member with nothing ready runs k = 0. A member leaving (finished, dropped, failed) frees its
region there; one preempted keeps it and goes on from its restored tokens. A worker that dies
leaves every member decoding plainly.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from forerun.propose.base import Draft, DraftRequest, Needs
from forerun.propose.drafter_hub import DrafterHub
from forerun.propose.drafter_messages import (
    FIRST_ROOT,
    Begin,
    Drafted,
    DrafterGone,
    Dropped,
    Prefill,
    Rest,
    Rooted,
    Verdict,
)
from forerun.propose.drafter_worker import DrafterProcess
from forerun.propose.reroot import AheadNode, AheadTree
from forerun.runtime.base import Runtime
from forerun.sampling import SamplingConfig

DRAFTER = "disaggregate-drafter"  # its key in ProposerContext.shared: the engine's worker's hub
ASYNC_BATCH = "disaggregate-batch"  # its key in ProposerContext.batch: the AsyncDraftBatch
DEFAULT_WAIT_S = 0.2  # the most a pass waits for a first draft node before it runs plain
DEFAULT_AHEAD = 16  # the most nodes the worker drafts past the root
SEED_RANGE = 2**62  # the worker's seed is drawn from the sequence's generator in [0, this)


@dataclass(frozen=True)
class DisaggregateConfig:
    draft_cores: tuple[int, ...] | None = None  # the worker's CPU cores (None: the last one)
    target_cores: tuple[int, ...] | None = None  # the target's (None: every other one)
    wait_s: float = DEFAULT_WAIT_S
    ahead: int = DEFAULT_AHEAD
    lookup: int = 0  # greedy: prompt-lookup guesses the worker's draft model checks in each of
    # its passes, drafting every one it agrees with in that pass (0: one token a pass)

    def __post_init__(self):
        if self.wait_s < 0 or self.ahead < 1 or self.lookup < 0:
            raise ValueError(f"disaggregate: wait_s and lookup must be >= 0 and ahead >= 1, "
                             f"got {self.wait_s}, {self.lookup}, {self.ahead}")
        if self.draft_cores is not None and self.target_cores is not None and \
                set(self.draft_cores) & set(self.target_cores):
            raise ValueError(f"disaggregate: the drafter's cores {list(self.draft_cores)} and "
                             f"the target's {list(self.target_cores)} overlap")

    def placement(self, available: set[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(draft cores, target cores) on the CPUs this process may use: the given ones, else
        the last core drafts and the others verify (one core: both share it)."""
        cores = sorted(available)
        unknown = set(self.draft_cores or ()) | set(self.target_cores or ())
        if unknown - available:
            raise ValueError(f"disaggregate: cores {sorted(unknown - available)} are not among "
                             f"this process's {cores}")
        draft = self.draft_cores or (cores[-1],)
        target = self.target_cores or tuple(c for c in cores if c not in draft) or draft
        return tuple(draft), tuple(target)


def parse_cores(text: str) -> tuple[int, ...]:
    """A --draft-cores / --target-cores value: 0,2 or 0-3 or 1."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"expected CPU cores as 0,2 or 0-3, got {text!r}") from None
    return tuple(dict.fromkeys(cores))


@dataclass(frozen=True)
class DraftRecipe:
    """How the worker loads the draft model (picklable: it is called in the new process)."""

    source: str  # what forerun.models.load.open_model resolves: catalog name, file, directory
    dtype: str = "auto"
    device: str = "cpu"
    context: int = 4096
    runtime: str = "torch"

    def __call__(self) -> Runtime:
        from forerun.models.load import open_model  # the worker's own import of the loaders

        return open_model(self.source).load(dtype=self.dtype, device=self.device,
                                            context=self.context, runtime=self.runtime)


def start_drafter(build: Callable[[], Runtime], vocab_size: int, cfg: DisaggregateConfig,
                  available: set[int]) -> tuple[DrafterProcess, tuple[int, ...]]:
    """The worker started on its cores -> it, and the cores left to the target."""
    draft, target = cfg.placement(available)
    return DrafterProcess(build, vocab_size, draft), target


class AsyncDraftProposer:
    """The engine's side of the pipeline: a Proposer whose drafts the worker made ahead.
    `hub`: the worker's channel shared with other sequences' proposers (None: its own);
    `slots`: its draft region's size in a pool (0: the context); `group`: the batch's
    `AsyncDraftBatch`, which takes every member's draft in one wait (None: alone)."""

    name = "draft"
    # told through `archive` when its sequence leaves the engine; drafts in another process
    needs = Needs(archive=True, remote=True)
    runtime = None  # drafting costs the target nothing (another process's cores)

    def __init__(self, worker: DrafterProcess, cfg: DisaggregateConfig,
                 hub: DrafterHub | None = None, slots: int = 0,
                 group: AsyncDraftBatch | None = None):
        self.worker, self.cfg, self.slots, self.group = worker, cfg, slots, group
        self.hub = hub if hub is not None else DrafterHub(worker)
        self.session = 0  # 0: no sequence open at the worker
        self.root_tokens: list[int] | None = None  # the sequence up to the pending token
        # the worker's tree as of its last Rooted (nodes arrive in that frame), and the
        # verdicts sent since, which it has not yet answered
        self.tree = AheadTree(FIRST_ROOT)
        self.pending: list[list[int]] = []
        self.confirmed = 0  # verdicts the worker answered
        self.failure: str | None = None  # why the worker stopped drafting (then: plain)
        self.newest = -1  # the newest node id received
        self.framed = -1  # ... when the worker's last Rooted arrived: older nodes were
        # drafted before it heard the verdict (ahead, while the target verified)
        # measured: seconds waited for a first node, passes that found none ready, draft nodes
        # handed to the target that were drafted ahead
        self.waited_s, self.empty, self.ahead_used = 0.0, 0, 0

    def prefill(self, prompt: list[int]) -> None:
        self.hub.close(self.session)
        self.root_tokens, self.tree, self.pending, self.confirmed = (
            None, AheadTree(FIRST_ROOT), [], 0)
        self.newest = self.framed = -1  # (a session's node ids start again at 0)
        if self.failure is not None:
            return
        self.session = self.hub.open()
        self._send(Prefill(self.session, list(prompt), self.slots))  # fed meanwhile

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        if self.failure is not None:
            return Draft.empty()
        try:
            self.advance(tokens, sampling, generator)
            view = self._collect() if k else None
        except DrafterGone as e:
            self._fail(str(e))
            return Draft.empty()
        return self.take(view, k)

    def commit(self, num_final: int) -> None:
        pass  # the verdict goes out with the next propose, which sees the committed tokens

    def rest(self) -> None:
        """The sequence ended: the worker stops drafting ahead for it (else it drafts on to
        `ahead` nodes, on its own cores, before it idles) and frees its region in a pool."""
        if self.session and self.session in self.hub.inboxes:
            self._send(Rest(self.session))
        self.hub.close(self.session)

    def archive(self, output: list[int]) -> None:
        self.rest()  # (the engine's hook for a sequence leaving it; the output is not kept)

    def advance(self, tokens: list[int], sampling: SamplingConfig,
                generator: torch.Generator) -> None:
        """Tell the worker what the target committed since the last root."""
        root = self.root_tokens
        if root is not None and tokens[:len(root)] == root:
            self.pending.append(tokens[len(root):])
            self._send(Verdict(self.session, tokens[len(root):]))
        else:
            if root is not None:  # the sequence went another way (not a verdict): start again
                self.prefill(tokens[:-1])
            seed = int(torch.randint(SEED_RANGE, (1,), generator=generator))
            self._send(Begin(self.session, list(tokens), sampling, seed, self.cfg.ahead,
                             self.cfg.lookup))
        self.root_tokens = list(tokens)

    def take(self, view: AheadTree | None, k: int) -> Draft:
        """Up to k nodes of `view`, the tree under the pending token (None: none asked)."""
        if view is None or not len(view):
            self.empty += view is not None
            return Draft.empty()
        ids, drafted, parents = view.draft(k)
        self.ahead_used += sum(1 for i in ids if self.pending or i <= self.framed)
        q = [view.nodes[i].q for i in ids]
        chain = parents == list(range(-1, len(ids) - 1))
        return Draft(torch.tensor(drafted, dtype=torch.long),  # [K]
                     None if q[0] is None else torch.stack(q),  # [K, V]
                     None if chain else torch.tensor(parents, dtype=torch.long))

    def view(self) -> AheadTree:
        """Read every message that has arrived -> the tree under the pending token: the
        worker's last confirmed frame re-rooted by the verdicts it has not answered yet, as it
        will re-root them (with at least these nodes: the channel keeps order, so the first
        child holding a token is found alike)."""
        self._drain()
        view = self.tree
        for n, tokens in enumerate(self.pending, start=self.confirmed + 1):
            view = view.reroot(tokens, FIRST_ROOT - n)
        return view

    def _collect(self) -> AheadTree:
        """The tree under the pending token; where it is empty, wait up to wait_s for a first
        node."""
        deadline = None
        while True:
            view = self.view()
            now = time.perf_counter()
            if len(view):
                return view
            deadline = deadline or now + self.cfg.wait_s
            if now >= deadline:
                return view
            self.hub.pump(deadline - now)
            self.waited_s += time.perf_counter() - now

    def _drain(self) -> None:
        """Take in every message that has arrived for this sequence: nodes into the confirmed
        frame, each Rooted re-rooting it by the verdict it answers."""
        self.hub.pump(0)
        for msg in self.hub.take(self.session):
            if isinstance(msg, Dropped):
                raise DrafterGone(msg.message)
            if isinstance(msg, Drafted):
                q = None if msg.q is None else torch.from_numpy(msg.q)  # [V]
                self.tree.add(msg.node, AheadNode(msg.parent, msg.token, q))
                self.newest = msg.node
            elif isinstance(msg, Rooted):
                self.confirmed, self.framed = self.confirmed + 1, self.newest
                self.tree = self.tree.reroot(self.pending.pop(0), FIRST_ROOT - self.confirmed)
                if msg.verdict != self.confirmed or msg.root != self.tree.root:
                    raise DrafterGone(f"the drafter's tree and ours parted (verdict "
                                      f"{msg.verdict}, root {msg.root} vs {self.tree.root})")

    def _send(self, msg) -> None:
        if self.failure is not None:
            return
        try:
            self.hub.send(msg)
        except DrafterGone as e:
            self._fail(str(e))

    def fail(self, why: str) -> None:
        """Decode on plainly from now on (the worker stopped drafting for this sequence)."""
        self._fail(why)

    def _fail(self, why: str) -> None:
        self.failure = why
        self.hub.close(self.session)
        warnings.warn(f"--disaggregate: {why}; this request decodes on without drafts (plain)",
                      RuntimeWarning, stacklevel=3)


class AsyncDraftBatch:
    """The batch's side of one worker drafting for all its members (their proposers' `group`):
    each step sends every member's verdict, then takes what the worker has drafted for each,
    waiting at most `wait_s` in all (not per member) for members with nothing ready yet; a
    member still without a node runs k = 0 in that pass."""

    def __init__(self, hub: DrafterHub, wait_s: float):
        self.hub, self.wait_s = hub, wait_s
        self.waited_s = 0.0  # seconds the batch's passes waited for first nodes

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        views: dict[int, AheadTree | None] = {}
        for i, r in enumerate(requests):
            p = r.proposer
            if p.failure is None:
                try:
                    p.advance(r.tokens, r.sampling, r.generator)
                    views[i] = AheadTree(FIRST_ROOT) if r.k else None
                except DrafterGone as e:
                    p.fail(str(e))
        started = time.perf_counter()
        deadline = started + self.wait_s
        while True:
            for i in [i for i, v in views.items() if v is not None]:
                try:
                    views[i] = requests[i].proposer.view()
                except DrafterGone as e:
                    requests[i].proposer.fail(str(e))
                    views.pop(i)
            now = time.perf_counter()
            if now >= deadline or all(v is None or len(v) for v in views.values()):
                break
            try:
                self.hub.pump(deadline - now)
            except DrafterGone:
                continue  # every member's view fails next round, and falls back to plain
        self.waited_s += time.perf_counter() - started
        return [requests[i].proposer.take(views[i], r.k) if i in views else Draft.empty()
                for i, r in enumerate(requests)]

    def backlog(self, proposer: AsyncDraftProposer, tokens: list[int]) -> int:
        return 0  # the worker feeds its own model, on its own cores

    def release(self, proposer: AsyncDraftProposer) -> None:
        proposer.rest()  # (its region in the worker's pool is freed there)
