"""MagicDec (Chen et al. 2024): drafts for long contexts from a sparse KV cache.

The drafter attends only to the first `sinks` tokens and the `window` most recent ones
(StreamingLLM's cache, `forerun.runtime.streaming.StreamingRuntime`), so a draft token costs the
same at 2k or 16k tokens of context and the drafter's cache has a fixed size; the target
verifies with its full cache, so the output is the target's exactly (the usual verifier). The
drafter is the draft model (`drafter = "draft"`) or the target's own weights (`"self"`).

Owns: its config and the choice of drafter. Drafting itself is the draft-model method's
(`DraftModelProposer`: autoregressive, q from the same sampling settings, rollback by
truncation) over the streaming view instead of a full cache.

The torch runtime only: the view runs the torch model's own layers. A llama.cpp model (whose KV
cache the view cannot shape) fails with a clear error. Where the view lives:
- one sequence (or a batch whose runtime is not the torch pool, no `BATCH_TARGET`): a sparse
  cache of its own over the drafter's weights, which it prefills; the target's cache untouched.
- a batch member with the draft model, which a batch shares (`SHARED_DRAFT`:
  `SharedDraftModel` over a `BatchTorchRuntime`): the batch's magicdec members draft together,
  one pass per draft position, over a sparse view of that draft's cache pool
  (`forerun.runtime.streaming_batch.StreamingBatchRuntime`, kept in `ProposerContext.batch`
  under its own key per (sinks, window): a batch may mix `draft` and `magicdec` members, each
  group drafting in its own passes over the one pool).
- a batch member with `self` (`BATCH_TARGET`, the batch's `BatchTorchRuntime`): MagicDec's
  self-speculation. The target drafts for itself by reading its own full prefilled cache
  sparsely (`SelfDraft`: a sparse view of the target's pool, the batch's `self` members in one
  pass per draft position). A member whose region holds its L committed tokens feeds its
  pending token and then each drafted token at positions L, L+1, ...; after the draft its
  region is cut back to L, and the verify pass, which feeds the same positions, overwrites
  those slots with the target's full-attention keys and values. No cache of its own, no draft
  prefill, no draft memory: the region already holds L + k + 1 slots for the verify; and a
  member keeping nothing of its own is preempted and readmitted as a plain one (`bind`).
"""

from __future__ import annotations

from dataclasses import dataclass

from forerun.propose.base import BATCH_TARGET, Draft, DraftRequest, Needs, Proposer, ProposerContext
from forerun.propose.draft_batch import SHARED_DRAFT, PooledDraft, SharedDraftModel
from forerun.propose.draft_model import DraftModelProposer, RootRow
from forerun.runtime.batch import BatchTorchRuntime
from forerun.runtime.streaming import StreamingRuntime
from forerun.runtime.streaming_batch import StreamingBatchRuntime
from forerun.runtime.torch_model import TorchRuntime

DEFAULT_SINKS = 4  # StreamingLLM's: four initial tokens hold most of the sink attention
DEFAULT_WINDOW = 256  # MagicDec's smallest draft budget (its 256-512 KV budgets)
DRAFTERS = ("draft", "self")
# where a batch keeps its magicdec members' SharedDraftModel (over the sparse view of the
# shared draft's pool) in ProposerContext.batch, followed by the sinks and the window
SHARED_MAGICDEC = "magicdec draft"
# and its `self` members' SelfDraft (over the sparse view of the target's own pool)
SELF_MAGICDEC = "magicdec self"


@dataclass(frozen=True)
class MagicDecConfig:
    sinks: int = DEFAULT_SINKS  # first tokens every draft query attends to
    window: int = DEFAULT_WINDOW  # most recent tokens every draft query attends to (itself incl.)
    drafter: str = "draft"  # "draft": the draft model; "self": the target's own weights

    def __post_init__(self):
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"magicdec needs sinks >= 0 and window >= 1, got {self.sinks} "
                             f"and {self.window}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"magicdec drafter must be one of {', '.join(DRAFTERS)}, got "
                             f"{self.drafter!r}")


class MagicDecProposer(DraftModelProposer):
    """The draft-model method over a StreamingRuntime (sinks + window) of the drafter."""

    name = "magicdec"


class PooledMagicDec(PooledDraft):
    """A batch member drafting with the batch's draft model over its sparse view."""

    name = "magicdec"


class SelfDraft(SharedDraftModel):
    """The target drafting for the batch's `self` members over a sparse view of its own pool:
    a member's draft rows go past its L committed tokens, and its region is cut back to L."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        committed: dict[int, int] = {}  # handle -> L, the member's committed tokens
        for r in requests:
            if r.k == 0:
                continue
            handle = r.proposer.handle
            length = self.runtime.length(handle) if handle >= 0 else -1
            if length != len(r.tokens) - 1:
                raise RuntimeError(f"magicdec (self) drafts over its target's cache, which holds "
                                   f"{length} tokens, not the {len(r.tokens) - 1} before the "
                                   "pending one (-1: not admitted)")
            committed[handle] = length
        try:
            return super().propose(requests)
        finally:  # the verify pass rewrites slots L.. with the target's own K/V
            for handle, length in committed.items():
                self.runtime.truncate(handle, length)

    def backlog(self, proposer: PooledDraft, tokens: list[int]) -> int:
        return 0  # its region holds all but the pending token: nothing to catch up

    def release(self, proposer: PooledDraft) -> None:
        proposer.handle = -1  # the region is the target's: the member's retirement frees it


class SelfMember(PooledDraft):
    """A batch member drafting with the target's own weights over its own pool region."""

    name = "magicdec"
    needs = Needs(grammar=True, target_region=True)  # its handle is its target region's

    def __init__(self, group: SelfDraft):
        super().__init__(group, slots=0)  # no region of its own to size

    def prefill(self, prompt: list[int]) -> None:
        """Nothing to feed nor reserve: the target's prefill fills the region it drafts over."""
        self.prompt_length, self.root = len(prompt), RootRow()

    def bind(self, seq: int) -> None:
        """Its region of the target's pool is `seq` (at each admission)."""
        self.handle, self.root = seq, RootRow()

    def commit(self, num_final: int) -> None:
        """Nothing: the target's commit has cut its region to what verification kept."""


def magicdec_proposer(cfg: MagicDecConfig, ctx: ProposerContext) -> Proposer:
    """The proposer of `cfg` for one sequence: the drafter's weights, a sparse cache of its own;
    for a batch member drafting with the batch's draft model, that model's sparse view; for a
    `self` member of a torch batch, the target's sparse view of its own pool."""
    batch = ctx.batch or {}
    if cfg.drafter == "draft" and batch.get(SHARED_DRAFT) is not None:
        return _batch_member(cfg, ctx, batch[SHARED_DRAFT])
    if cfg.drafter == "self" and isinstance(batch.get(BATCH_TARGET), BatchTorchRuntime):
        return _self_member(cfg, ctx, batch[BATCH_TARGET])
    if cfg.drafter == "draft" and ctx.draft is None:
        raise ValueError("magicdec with --magicdec-drafter draft needs a draft model (--draft); "
                         "or use --magicdec-drafter self")
    if cfg.drafter == "draft" and ctx.bridge is not None:
        raise ValueError("magicdec drafts with a draft model of the target's vocabulary; this "
                         "draft's tokenizer differs: use --method draft, or --magicdec-drafter "
                         "self")
    base = ctx.target if cfg.drafter == "self" else ctx.draft
    if not isinstance(base, TorchRuntime):
        raise ValueError(f"magicdec drafts from a sparse KV cache of the torch model's own; its "
                         f"{cfg.drafter} model runs on {type(base).__name__}: use --runtime torch")
    capacity = ctx.capacity or ctx.target.capacity
    view = StreamingRuntime(base, cfg.sinks, cfg.window, capacity)
    return MagicDecProposer(view, ctx.target.config.vocab_size)


def _batch_member(cfg: MagicDecConfig, ctx: ProposerContext, shared) -> PooledMagicDec:
    """A member's proposer over the batch's sparse view of its draft model (built at the first
    member of these sinks and window)."""
    if not (isinstance(shared, SharedDraftModel) and isinstance(shared.runtime,
                                                                BatchTorchRuntime)):
        raise ValueError("magicdec drafts from a sparse KV cache of the torch draft model's own, "
                         "of the target's vocabulary; this batch's draft is "
                         f"{type(shared).__name__} over {type(shared.runtime).__name__}: use "
                         "--runtime torch and a draft of the target's tokenizer, or "
                         "--magicdec-drafter self")
    key = f"{SHARED_MAGICDEC} {cfg.sinks} {cfg.window}"
    if key not in ctx.batch:
        view = StreamingBatchRuntime(shared.runtime, cfg.sinks, cfg.window)
        ctx.batch[key] = SharedDraftModel(view, shared.vocab_size)
    return PooledMagicDec(ctx.batch[key], ctx.capacity or ctx.target.capacity)


def _self_member(cfg: MagicDecConfig, ctx: ProposerContext, target: BatchTorchRuntime
                 ) -> SelfMember:
    """A `self` member's proposer over the batch's sparse view of the target's own pool (built
    at the first member of these sinks and window)."""
    key = f"{SELF_MAGICDEC} {cfg.sinks} {cfg.window}"
    if key not in ctx.batch:
        view = StreamingBatchRuntime(target, cfg.sinks, cfg.window)
        ctx.batch[key] = SelfDraft(view, target.config.vocab_size)
    return SelfMember(ctx.batch[key])
