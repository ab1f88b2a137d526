"""A running batch that sequences join and leave between passes: continuous batching.

Owns: `BatchSession`, the scheduler over `forerun.batch_engine`: building a batch member from a
request (its drafter, length policy and cache slack, `sequence`), the FIFO of members waiting
for KV memory, admission (in arrival order, while the pool has room and `max_batch` allows),
one pass over the live members (`step`), prompt blocks reused from a `PrefixCache` where an
earlier prompt began the same way, and leaving: finished members are retired after
their pass, `drop` retires a member now (a client gone: its cache is free before the next
pass). A member that fails (its drafter raised) leaves alone; the others go on.

Speculation follows the load through `joint`: the batch's cost policy
(`forerun.batch_policy`) chooses every member's draft length together from the measured cost
of a pass of that many rows, each member's own k as its cap, so drafting shrinks as the batch
fills and comes back as it empties. Without `joint` each member drafts by its own policy.

`Engine.generate_batch` and the server's worker both drive one. Knows nothing of text or HTTP.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forerun.batch_engine import PREFILL_SHARE, Sequence, admit, reads_prompt, retire, step
from forerun.batch_policy import BatchCost, BatchCostPolicy
from forerun.grammar import state_for
from forerun.heads import KINDS
from forerun.metrics import Step
from forerun.models.catalog import ModelError
from forerun.policy import POLICIES, FixedK
from forerun.prefix_cache import PrefixCache
from forerun.profile import LiveCurve
from forerun.propose import AUTO_TREE, AUTO_TREE_MAX, PROPOSERS, ProposerContext, SpecConfig
from forerun.propose.base import BATCH_TARGET
from forerun.propose.cross_draft import SharedCrossDraft
from forerun.propose.disaggregate import ASYNC_BATCH, DRAFTER, AsyncDraftBatch
from forerun.propose.draft_batch import SHARED_DRAFT, SharedDraftModel
from forerun.runtime.base import Runtime
from forerun.runtime.batch import PoolFull
from forerun.runtime.views import kv_token_bytes
from forerun.sampling import SamplingConfig, make_generator

if TYPE_CHECKING:
    from forerun.api import Engine

MAX_BATCH_K = 16  # the adaptive policy's longest draft (AdaptiveK.k_max): its cache slack
GROW_TOKENS = 64  # `lazy`: slots a region takes beyond its prompt, and grows by, at a time


@dataclass
class BatchSession:
    """Members of one batch over `engine`'s batched views, their KV memory `kv_budget_bytes`
    per model; at most `max_batch` live (None: as many as fit), each pass at most
    `max_batch_tokens` rows (None: whole prompts), prompts taking at least `prefill_share`."""

    engine: Engine
    kv_budget_bytes: int
    joint: bool = False
    max_batch: int | None = None
    max_batch_tokens: int | None = None
    prefill_share: float = PREFILL_SHARE
    prefix_cache_bytes: int = 0  # prompt blocks' KV kept for later prompts (0: none)
    # reserve a prompt + GROW_TOKENS and grow while decoding (the youngest member preempted
    # when memory runs out), not the worst case; only where the runtime can grow one
    lazy: bool = False
    preempted: int = 0  # preemptions since start
    waiting: deque[Sequence] = field(default_factory=deque)
    live: list[Sequence] = field(default_factory=list)
    # state its members' drafters share (ProposerContext.batch): heads', the draft model
    _group: dict[str, Any] = field(default_factory=dict)
    _draft: SharedDraftModel | SharedCrossDraft | None = None
    _lengths: BatchCostPolicy | None = None
    pass_size: int = 0  # members in the last pass

    def __post_init__(self):
        self.target = self.engine.batch_view("target", self.kv_budget_bytes)
        self.prefix = (PrefixCache(self.prefix_cache_bytes) if self.prefix_cache_bytes
                       and self.target.capabilities.kv_copy else None)
        self.lazy = self.lazy and self.target.capabilities.kv_grow
        if self.target.capabilities.resume_rows:  # early exit drafts in its member's region
            self._group[BATCH_TARGET] = self.target

    # --- members -----------------------------------------------------------------------------

    def sequence(self, ids: list[int], sampling: SamplingConfig, max_tokens: int,
                 spec: SpecConfig | None = None, logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> Sequence:
        """A member for prompt `ids` (not yet added): its drafter for `spec` (the engine's by
        default; method none = plain decoding), its generator, policy and cache slack. Raises
        ValueError / ModelError for a spec this engine cannot draft with."""
        spec, engine = spec or self.engine.spec, self.engine
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        sampling.processing.check_vocab(engine.target.config.vocab_size)
        seq = Sequence(ids, sampling, max_tokens, make_generator(sampling.seed),
                       engine.tokenizer.stop_ids, logprobs=logprobs,
                       prompt_logprobs=prompt_logprobs,
                       grammar=state_for(sampling.grammar, engine.tokenizer,
                                         engine.target.config.vocab_size))
        if spec.method == "none":
            return seq
        seq.max_k, seq.shadow = max_nodes(spec), spec.shadow
        if spec.method in KINDS and engine.heads is not None and not (
                self.target.capabilities.exposes(engine.heads.cfg.layers)):
            raise ModelError(f"{spec.method} heads draft from the target's features, which "
                             "this runtime's batched passes do not return; use --runtime "
                             "torch, or decode one prompt at a time (generate)")
        if spec.uses_draft and spec.disaggregate:  # the engine's worker drafts for them all
            self._async_batch(spec)
        elif spec.uses_draft:  # the batch's draft model drafts for every member that uses it
            self._group[SHARED_DRAFT] = self._shared_draft()
        # each member its own drafter state (and stores: an EAGLE head's cache)
        seq.proposer = PROPOSERS[spec.method](spec, ProposerContext(
            engine.target, None, engine.heads, engine.tokenizer, capacity=seq.slots(),
            batch=self._group, shared=engine.proposers.shared))
        # under `joint` the batch's cost policy chooses k (capped by max_k, the request's k)
        seq.policy = (FixedK(spec.k) if self.joint else
                      POLICIES[spec.policy](spec, engine.target, seq.proposer.runtime))
        return seq

    def add(self, seq: Sequence) -> None:
        """Queue a member; it joins the batch at a pass where its KV memory is free."""
        self.waiting.append(seq)

    def drop(self, seq: Sequence) -> None:
        """Take a member out now, waiting or live: its cache regions are free at once."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.live:
            self._leave(seq)

    def drop_all(self) -> list[Sequence]:
        """Retire every live member (after a failed pass) -> them; the waiting stay."""
        left = list(self.live)
        for seq in left:
            self._leave(seq)
        return left

    def kv_bytes(self) -> int:
        """KV-cache bytes the members hold now, the target's and the shared draft's."""
        return self.target.kv_bytes() + (self._draft.runtime.kv_bytes() if self._draft else 0)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.live)

    # --- the pass ----------------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, Step | None]]:
        """Admit what fits, run one pass over the live members, retire the finished -> every
        member that emitted or ended (Step None: it failed, `seq.error` says why)."""
        ended = self._admit() + (self._make_room() if self.lazy else [])
        self.pass_size = len(self.live)
        if not self.live:
            return ended
        results = step(self.target, self.live, self._policy(), self.max_batch_tokens,
                       self.prefill_share)
        out = ended + [(s, r) for s, r in zip(self.live, results, strict=True)
                       if r is not None or s.error is not None]
        if self.prefix is not None:  # a prompt now cached: keep its blocks for later prompts
            for s, r in out:
                if r is not None and r.prefill:
                    self.prefix.store(self.target, s.handle, s.prompt)
        for s in [s for s in self.live if s.finish]:
            self._leave(s)
        return out

    def _admit(self) -> list[tuple[Sequence, Step | None]]:
        """Waiting members into the batch in arrival order while memory and max_batch allow;
        -> those that can never run (a prompt over the context, a pool too small), failed."""
        failed = []
        while self.waiting and (self.max_batch is None or len(self.live) < self.max_batch):
            seq = self.waiting[0]
            reserve = (len(seq.source()) + seq.max_k + 1 + GROW_TOKENS) if self.lazy else None
            try:
                admit(self.target, seq, reserve)
            except PoolFull as e:
                if self.live:  # memory frees as members finish: wait
                    break
                seq.fail(PoolFull(f"the KV cache budget cannot hold this request ({e}); "
                                  "raise the budget or lower max_tokens"))
            except (ValueError, ModelError) as e:
                seq.fail(e)
            self.waiting.popleft()
            if seq.error is None:
                if self.prefix is not None and not reads_prompt(seq):
                    seq.fed = self.prefix.load(self.target, seq.handle, seq.source())
                self.live.append(seq)
            else:
                failed.append((seq, None))
        return failed

    def _make_room(self) -> list[tuple[Sequence, Step | None]]:
        """`lazy`: every decoding member's region grown to hold its next verify pass; where
        the pool is short, the youngest preemptible member is preempted (its cache freed, its
        place at the head of the queue, its cache recomputed when it comes back) until it
        fits (or is itself the youngest). -> members that could not be given room, failed."""
        failed = []
        for s in list(self.live):
            if s.handle < 0 or not s.prefilled:
                continue
            want = min(s.slots(), len(s.tokens) + s.max_k)  # the cache after its verify pass
            if self.target.reserved(s.handle) >= want:
                continue
            size = min(s.slots(), max(want, self.target.reserved(s.handle) + GROW_TOKENS))
            while s.handle >= 0:
                try:
                    self.target.grow(s.handle, size)
                    break
                except PoolFull:  # (never draft less for want of room: a seeded member
                    # draws as it would in any pool)
                    victim = next((v for v in reversed(self.live) if _preemptible(v)), None)
                    if victim is None or self.live == [s]:  # nothing left to free
                        s.fail(PoolFull("the KV cache budget cannot hold this request; raise "
                                        "the budget or lower max_tokens"))
                        failed.append((s, None))
                        self._leave(s)
                        break
                    self._preempt(victim)
        return failed

    def _preempt(self, seq: Sequence) -> None:
        """Free a live member's cache and queue it first; it resumes where it was."""
        self.target.release(seq.handle)
        seq.handle = -1
        if seq.prefilled:
            seq.resume = seq.tokens
        seq.tokens, seq.fed = [], 0
        self.live.remove(seq)
        self.waiting.appendleft(seq)
        self.preempted += 1

    def _leave(self, seq: Sequence) -> None:
        retire(self.target, seq)
        self.live.remove(seq)
        if self._lengths is not None:
            self._lengths.forget(id(seq))

    def _policy(self) -> BatchCostPolicy | None:
        """The joint cost policy over the target's (and the shared draft's) measured pass costs;
        rebuilt, keeping its estimates, when a draft model joins."""
        if not self.joint or all(s.proposer is None for s in self.live):
            return None  # nobody drafts: nothing to choose (and no pass costs to measure)
        return self._built_policy()

    def _built_policy(self) -> BatchCostPolicy:
        """The joint policy, its pass costs measured at its first build (or the draft's when
        a draft model has joined since)."""
        wants_draft = self._draft is not None and self._lengths is not None and \
            self._lengths.cost.draft_round is None
        if self._lengths is None or wants_draft:
            # the target's curve corrected by the passes it runs (the draft's by a ratio)
            cost = BatchCost(LiveCurve(self.engine.batch_curve(self.target)),
                             None if self._draft is None
                             else self.engine.batch_curve(self._draft.runtime))
            self._lengths = BatchCostPolicy(cost, {} if self._lengths is None
                                            else self._lengths.estimates)
        return self._lengths

    def calibrate(self) -> None:
        """Measure now the pass costs the joint policy reads (else its first pass does)."""
        if not self.joint:
            return
        if self.engine.draft is not None:
            self._shared_draft()
        self._built_policy()  # (even with no member yet: a server calls it before serving)

    def _async_batch(self, spec: SpecConfig) -> None:
        """--disaggregate: the engine's drafter worker drafts for every member, from a pool of
        as many tokens as the target's (opened once, at the first such member)."""
        hub = self.engine.proposers.shared.get(DRAFTER)
        if hub is None:
            raise ValueError("--disaggregate needs the drafter worker an Engine starts for it "
                             "(forerun.Engine with SpecConfig(disaggregate=True))")
        if ASYNC_BATCH not in self._group:
            hub.open_pool(max(1, self.kv_budget_bytes // kv_token_bytes(self.engine.target)))
            self._group[ASYNC_BATCH] = AsyncDraftBatch(hub, spec.disaggregate_wait)

    def _shared_draft(self) -> SharedDraftModel | SharedCrossDraft:
        if self.engine.draft is None:
            raise ValueError("method 'draft' needs a draft model (--draft)")
        if self._draft is None:
            # the draft reserves each member's worst case, which a target growing its regions
            # (`lazy`) does not; another tokenizer counts other tokens: the whole budget then
            bridge = self.engine.bridge
            budget = self.kv_budget_bytes if bridge is not None or self.lazy else draft_budget(
                self.engine.target, self.engine.draft, self.kv_budget_bytes)
            view = self.engine.batch_view("draft", budget)
            self._draft = (SharedDraftModel(view, self.engine.target.config.vocab_size)
                           if bridge is None else SharedCrossDraft(view, bridge))
        return self._draft


def draft_budget(target: Runtime, draft: Runtime, budget: int) -> int:
    """The shared draft pool's bytes: room for as many tokens as the target's pool of `budget`
    bytes holds (each member reserves the same slots in both), not `budget` again, which a
    smaller draft would never fill (llama.cpp allocates its whole context at once)."""
    return min(budget, budget // kv_token_bytes(target) * kv_token_bytes(draft))


def _preemptible(seq: Sequence) -> bool:
    """A member whose cache alone can be freed and recomputed: its drafter keeps no cache
    region of its own (a shared draft model's) and reads no features of the prompt's rows."""
    needs = None if seq.proposer is None else seq.proposer.needs
    return needs is None or ((seq.proposer.group is None or needs.remote or needs.target_region)
                             and not reads_prompt(seq))


def max_nodes(spec: SpecConfig) -> int:
    """The most draft nodes one verify pass of a batch member may hold (its cache slack): a
    chain's k (the adaptive policy's longest), a head tree's node budget (an automatic one's
    most, and a lookup branch's chain beside it; multi's k per method it joins)."""
    k = MAX_BATCH_K if spec.policy == "adaptive" else spec.k
    if spec.method == "multi":
        return k * len(spec.multi_methods)
    if spec.method not in KINDS or spec.tree == 0:
        return k + (k if spec.lookup else 0)
    return (AUTO_TREE_MAX if spec.tree == AUTO_TREE else spec.tree) + (k if spec.lookup else 0)
