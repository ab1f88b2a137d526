"""MagicDec (Chen et al. 2024): drafts for long contexts from a sparse KV cache.

The drafter attends only to the first `sinks` tokens and the `window` most recent ones
(StreamingLLM's cache, `forerun.runtime.streaming.StreamingRuntime`), so a draft token costs the
same at 2k or 16k tokens of context and the drafter's cache has a fixed size; the target
verifies with its full cache, so the output is the target's exactly (the usual verifier). The
drafter is the draft model (`drafter = "draft"`) or the target's own weights (`"self"`) over a
sparse cache of their own, the target's full cache untouched.

Owns: its config and the choice of drafter. Drafting itself is the draft-model method's
(`DraftModelProposer`: autoregressive, q from the same sampling settings, rollback by
truncation) over the streaming view instead of a full cache.

The torch runtime only: the view runs the torch model's own layers over its own cache. A
llama.cpp model (whose KV cache the view cannot shape) fails with a clear error. In a batch
each member drafts alone over its own view (`self`); with the draft model, which a batch shares
(`SHARED_DRAFT`: `SharedDraftModel` over a `BatchTorchRuntime`), the batch's magicdec members
draft together, one pass per draft position, over a sparse view of that draft's cache pool
(`forerun.runtime.streaming_batch.StreamingBatchRuntime`, kept in `ProposerContext.batch` under
its own key per (sinks, window): a batch may mix `draft` and `magicdec` members, each group
drafting in its own passes over the one pool).
"""

from __future__ import annotations

from dataclasses import dataclass

from forerun.propose.base import Proposer, ProposerContext
from forerun.propose.draft_batch import SHARED_DRAFT, PooledDraft, SharedDraftModel
from forerun.propose.draft_model import DraftModelProposer
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


def magicdec_proposer(cfg: MagicDecConfig, ctx: ProposerContext) -> Proposer:
    """The proposer of `cfg` for one sequence: the drafter's weights, a sparse cache of its own;
    for a batch member drafting with the batch's draft model, that model's sparse view."""
    shared = None if ctx.batch is None else ctx.batch.get(SHARED_DRAFT)
    if cfg.drafter == "draft" and shared is not None:
        return _batch_member(cfg, ctx, shared)
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
