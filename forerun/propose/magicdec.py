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
each member drafts alone over its own view (`self`); the draft model, which a batch shares
(`SHARED_DRAFT`), drafts one sequence at a time here and fails clearly in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from forerun.propose.base import ProposerContext
from forerun.propose.draft_model import DraftModelProposer
from forerun.runtime.streaming import StreamingRuntime
from forerun.runtime.torch_model import TorchRuntime

DEFAULT_SINKS = 4  # StreamingLLM's: four initial tokens hold most of the sink attention
DEFAULT_WINDOW = 256  # MagicDec's smallest draft budget (its 256-512 KV budgets)
DRAFTERS = ("draft", "self")


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


def magicdec_proposer(cfg: MagicDecConfig, ctx: ProposerContext) -> MagicDecProposer:
    """The proposer of `cfg` for one sequence: the drafter's weights, a sparse cache of its own."""
    if cfg.drafter == "draft" and ctx.draft is None:
        raise ValueError("magicdec with --magicdec-drafter draft needs a draft model (--draft), "
                         "drafting one sequence at a time (not in a batch); or use "
                         "--magicdec-drafter self")
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
