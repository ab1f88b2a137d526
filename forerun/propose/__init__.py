"""Drafting methods, each one module behind the Proposer protocol, registered in PROPOSERS.

A factory takes the speculation config and a `ProposerContext` (the models and stores it may
use) and returns a Proposer: `PROPOSERS[method](spec, ctx)`. The engine looks methods up here
and never branches on their names; what a proposer needs of it, it declares in `needs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from forerun.heads import Heads
from forerun.profile import calibrated_curve
from forerun.propose.base import Draft, Needs, Proposer, ProposerContext
from forerun.propose.cross_draft import CrossVocabProposer
from forerun.propose.disaggregate import (
    ASYNC_BATCH,
    DEFAULT_WAIT_S,
    DRAFTER,
    AsyncDraftProposer,
    DisaggregateConfig,
)
from forerun.propose.draft_batch import SHARED_DRAFT
from forerun.propose.draft_model import DraftModelProposer
from forerun.propose.eagle import EagleProposer, shared_eagle
from forerun.propose.early_exit import EarlyExitConfig, early_exit_proposer
from forerun.propose.heads import AUTO_TREE, AUTO_TREE_MAX, HeadProposer, VerifyCurve
from forerun.propose.layer_skip import LayerSkipConfig, layer_skip_proposer
from forerun.propose.lookahead import (
    DEFAULT_GUESSES,
    DEFAULT_NGRAM,
    DEFAULT_WINDOW,
    LookaheadConfig,
    LookaheadProposer,
)
from forerun.propose.magicdec import (
    DEFAULT_SINKS,
    MagicDecConfig,
    magicdec_proposer,
)
from forerun.propose.magicdec import DEFAULT_WINDOW as MAGICDEC_WINDOW
from forerun.propose.medusa import (
    ONLINE_TEACHER,
    HydraProposer,
    MedusaProposer,
    shared_heads,
)
from forerun.propose.multi import DEFAULT_METHODS, MultiConfig, MultiProposer
from forerun.propose.ngram import LookupBranch, NgramProposer
from forerun.propose.qspec import QSpecConfig, qspec_proposer
from forerun.propose.suffix import (
    DEFAULT_CACHE_TOKENS,
    DEFAULT_FACTOR,
    DEFAULT_MIN_PROB,
    SuffixConfig,
    SuffixProposer,
    shared_index,
)


@dataclass(frozen=True)
class SpecConfig:
    method: str = "draft"  # "none" (plain decoding) or a key of PROPOSERS
    k: int = 4  # draft tokens per step (the start value for adaptive, the cap for cost)
    policy: str = "fixed"  # a key of forerun.policy.POLICIES
    ngram_min: int = 1
    ngram_max: int = 4
    tree: int = 0  # head methods: draft-tree node budget (0 = a chain of k, AUTO_TREE = from
    # the target's verify-cost curve, measured at first use)
    tree_topk: int = 4  # head methods: children kept per expanded tree node
    lookup: bool = False  # head methods: the prompt-lookup continuation (ngram_min..ngram_max
    # suffixes, k long) joins each draft as one more branch
    shadow: bool = False  # draft and verify, count what would have been accepted, but emit one
    # token a pass, as plain decoding does: acceptance measured before speculation is turned on
    suffix_cache_tokens: int = DEFAULT_CACHE_TOKENS  # suffix: the global index of earlier
    # outputs, in tokens (0 = none); the first suffix proposer of an engine sizes it
    suffix_factor: float = DEFAULT_FACTOR  # suffix: draft nodes per matched token
    suffix_min_prob: float = DEFAULT_MIN_PROB  # suffix: no draft node estimated less likely
    suffix_cache_dir: str | None = None  # suffix: where the global index is kept between runs
    multi_methods: tuple[str, ...] = DEFAULT_METHODS  # multi: the methods whose drafts join
    multi_verifier: str = "rrs"  # multi: rrs (a merged trie) or spectr (i.i.d. drafts apart)
    lookahead_window: int = DEFAULT_WINDOW  # lookahead: W, the most guessed positions a level
    lookahead_ngram: int = DEFAULT_NGRAM  # lookahead: N, the n-gram size (N - 1 levels)
    lookahead_guesses: int = DEFAULT_GUESSES  # lookahead: G, the most n-grams verified a pass
    lookahead_auto: bool = True  # lookahead: size the window per pass from the verify curve
    skip_layers: tuple[int, ...] | None = None  # layer-skip: the layers its draft leaves out
    # (None = the set `forerun tune layer-skip` saved for the target, else a default)
    magicdec_sinks: int = DEFAULT_SINKS  # magicdec: first tokens every draft query attends to
    magicdec_window: int = MAGICDEC_WINDOW  # magicdec: and the most recent ones
    magicdec_drafter: str = "draft"  # magicdec: "draft" (the draft model) or "self" (the target)
    qspec_runtime: str = "auto"  # qspec: the draft's runtime (torch, llama.cpp, auto)
    qspec_bits: int = 8  # qspec: the torch draft's weight bits (8, 4)
    qspec_activations: int = 16  # qspec: the torch draft's activation bits (16, 8)
    qspec_type: str | None = None  # qspec: a llama.cpp draft's file requantized to this type
    exit_layer: int | None = None  # early-exit: E, the target layers its draft runs (None =
    # forerun.propose.early_exit.default_layer)
    exit_adapter: str | None = None  # early-exit: the exit adapter's file, "none" (identity),
    # or None (the one `forerun train early-exit` saved for the target and E, else identity)
    disaggregate: bool = False  # draft: the draft model drafts ahead in a worker process of its
    # own while the target verifies (forerun.propose.disaggregate); a batch's members share it
    draft_cores: tuple[int, ...] | None = None  # disaggregate: the worker's CPU cores
    target_cores: tuple[int, ...] | None = None  # disaggregate: the target's
    disaggregate_wait: float = DEFAULT_WAIT_S  # disaggregate: the most a pass waits for a draft
    disaggregate_lookup: int = 0  # disaggregate, greedy: lookup guesses a draft pass checks
    drafter_placement: str | None = None  # disaggregate: the worker as a Ray actor in a
    # placement group of this strategy (PACK, SPREAD: forerun.cluster.drafter_actor); None: a
    # process on this machine

    def __post_init__(self):
        if self.method != "none" and self.method not in PROPOSERS:
            raise ValueError(f"unknown method {self.method!r}; choose none, {', '.join(PROPOSERS)}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if self.tree < AUTO_TREE or self.tree_topk < 1:
            raise ValueError(f"tree must be >= 0 (or AUTO_TREE = {AUTO_TREE}) and tree_topk "
                             f">= 1, got {self.tree}, {self.tree_topk}")
        if self.lookup and self.method not in HEAD_PROPOSERS:
            raise ValueError(f"lookup joins a head method's drafts ({', '.join(HEAD_PROPOSERS)}"
                             f"), not {self.method!r}; for lookup alone use --method ngram")
        self.suffix()  # checks the suffix method's options: a clear error for a bad one
        self.lookahead()  # and lookahead's
        self.layer_skip()  # and layer-skip's
        self.magicdec()  # and magicdec's
        self.qspec()  # and qspec's
        self.early_exit()  # and early-exit's
        self.disaggregated()  # and the pipeline's
        if self.drafter_placement is not None and not self.disaggregate:
            raise ValueError("a drafter placement (--ray) places the --disaggregate worker: add "
                             "--disaggregate")
        if self.disaggregate and self.method != "draft":
            raise ValueError(f"--disaggregate runs the draft model in a worker; --method "
                             f"{self.method} drafts in process (use --method draft)")
        if "lookahead" in self.multi().methods:
            raise ValueError("multi: lookahead cannot join (its draft carries its Jacobi "
                             "window, which a merged tree would break); use --method lookahead")
        unknown = [m for m in self.multi().methods if m not in PROPOSERS]
        if unknown:
            raise ValueError(f"multi: unknown methods {unknown}; choose from "
                             f"{', '.join(m for m in PROPOSERS if m != 'multi')}")

    def suffix(self) -> SuffixConfig:
        """The suffix method's own options."""
        return SuffixConfig(self.suffix_cache_tokens, self.suffix_factor, self.suffix_min_prob,
                            self.suffix_cache_dir)

    def lookahead(self) -> LookaheadConfig:
        """The lookahead method's own options."""
        return LookaheadConfig(self.lookahead_window, self.lookahead_ngram,
                               self.lookahead_guesses, self.lookahead_auto)

    def magicdec(self) -> MagicDecConfig:
        """The magicdec method's own options."""
        return MagicDecConfig(self.magicdec_sinks, self.magicdec_window, self.magicdec_drafter)

    def layer_skip(self) -> LayerSkipConfig:
        """The layer-skip method's own options."""
        return LayerSkipConfig(self.skip_layers)

    def early_exit(self) -> EarlyExitConfig:
        """The early-exit method's own options."""
        return EarlyExitConfig(self.exit_layer, self.exit_adapter)

    def disaggregated(self) -> DisaggregateConfig:
        """The asynchronous pipeline's own options (placement, waiting)."""
        return DisaggregateConfig(self.draft_cores, self.target_cores, self.disaggregate_wait,
                                  lookup=self.disaggregate_lookup)

    def qspec(self) -> QSpecConfig:
        """The qspec method's own options."""
        return QSpecConfig(self.qspec_runtime, self.qspec_bits, self.qspec_activations,
                           self.qspec_type)

    def multi(self) -> MultiConfig:
        """The multi method's own options."""
        return MultiConfig(tuple(self.multi_methods), self.multi_verifier)

    @property
    def uses_draft(self) -> bool:
        """Whether it drafts with the draft model (method draft, multi with draft, magicdec
        with the draft model as its drafter)."""
        return self.method == "draft" or (self.method == "multi" and
                                          "draft" in self.multi_methods) or (
            self.method == "magicdec" and self.magicdec_drafter == "draft")


def tree_budget(text: str) -> int:
    """A --tree value: a node count (0 = chains), or `auto` (AUTO_TREE)."""
    if text == "auto":
        return AUTO_TREE
    if not text.isdigit():
        raise ValueError(f"expected a node count or auto, got {text!r}")
    return int(text)


def _draft(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    if spec.disaggregate:  # the engine's worker drafts ahead, in its own process
        hub = None if ctx.shared is None else ctx.shared.get(DRAFTER)
        if hub is None:
            raise ValueError("--disaggregate needs the drafter worker an Engine starts for it "
                             "(forerun.Engine with SpecConfig(disaggregate=True))")
        group = None if ctx.batch is None else ctx.batch.get(ASYNC_BATCH)  # a batch member's
        return AsyncDraftProposer(hub.worker, spec.disaggregated(), hub, ctx.capacity or 0,
                                  group)
    shared = None if ctx.batch is None else ctx.batch.get(SHARED_DRAFT)
    if shared is not None:  # a batch member: the batch's draft model drafts for it and others
        return shared.proposer(ctx.capacity)
    if ctx.draft is None:
        raise ValueError("method 'draft' needs a draft model (--draft)")
    if ctx.bridge is not None:  # a draft of another vocabulary: through the text and TLI
        return CrossVocabProposer(ctx.draft, ctx.bridge)
    return DraftModelProposer(ctx.draft, ctx.target.config.vocab_size)


def _ngram(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    return NgramProposer(spec.ngram_min, spec.ngram_max)


def _suffix(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    cfg = spec.suffix()
    return SuffixProposer(cfg, ctx.capacity or ctx.target.capacity, shared_index(ctx.shared, cfg))


def _lookahead(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    """With `auto`, the target's verify-cost curve up to the most rows a pass adds (measured
    at first use)."""
    cfg = spec.lookahead()
    curve = calibrated_curve(ctx.target, cfg.max_rows + 1) if cfg.auto else None
    return LookaheadProposer(cfg, curve)


def _magicdec(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    return magicdec_proposer(spec.magicdec(), ctx)


def _layer_skip(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    return layer_skip_proposer(spec.layer_skip(), ctx.target, ctx.capacity, ctx.stores)


def _early_exit(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    return early_exit_proposer(spec.early_exit(), ctx)


def _qspec(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    return qspec_proposer(spec.qspec(), ctx)


def _multi(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    """One proposer per sub-method (one listed k times drafts k times), each as it would be
    built alone (no batch's shared heads) but the draft model's: a batch's shared one."""
    cfg = spec.multi()
    draft = None if ctx.batch is None else ctx.batch.get(SHARED_DRAFT)
    sub = replace(ctx, batch=None if draft is None else {SHARED_DRAFT: draft})
    built = {m: PROPOSERS[m](replace(spec, method=m), sub) for m in dict.fromkeys(cfg.methods)}
    return MultiProposer([built[m] for m in cfg.methods], cfg)


HeadArgs = tuple[Heads, int, int, int, VerifyCurve | None, bool, LookupBranch | None]


def _head_args(spec: SpecConfig, ctx: ProposerContext) -> HeadArgs:
    """What every head method checks and builds its proposer from: the heads (present, and of
    the method's kind), the target's capacity, the tree and its verify curve, whether the
    prompt's features are read, the lookup branch (HeadProposer's arguments, in order)."""
    target, heads = ctx.target, ctx.heads
    if heads is None:
        raise ValueError(f"method {spec.method!r} needs trained heads (--heads PATH; make them "
                         f"with `forerun train {spec.method}`)")
    if heads.cfg.kind != spec.method:
        raise ValueError(f"--heads holds {heads.cfg.kind} heads, not {spec.method}; use "
                         f"--method {heads.cfg.kind}")
    verify = calibrated_curve(target, AUTO_TREE_MAX + 1) if spec.tree == AUTO_TREE else None
    # where each hidden row costs an LM-head row (stock llama.cpp: ~3 ms a row for the default
    # target here, 0.4 s for a 120-token prompt), heads skip the prompt's features
    prompt_features = not target.capabilities.hidden_costs_logits
    lookup = LookupBranch(spec.ngram_min, spec.ngram_max) if spec.lookup else None
    capacity = ctx.capacity or target.capacity  # a batch member's own length, else the context
    return heads, capacity, spec.tree, spec.tree_topk, verify, prompt_features, lookup


def _medusa(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    args = _head_args(spec, ctx)
    teacher = None if ctx.shared is None else ctx.shared.get(ONLINE_TEACHER)  # online distill
    return MedusaProposer(*args, group=shared_heads(ctx.batch, ctx.heads), teacher=teacher)


def _hydra(spec: SpecConfig, ctx: ProposerContext) -> Proposer:
    args = _head_args(spec, ctx)
    return HydraProposer(*args, group=shared_heads(ctx.batch, ctx.heads))


def _eagle(spec: SpecConfig, ctx: ProposerContext) -> Proposer:  # eagle and eagle3
    return EagleProposer(*_head_args(spec, ctx), store=ctx.stores,
                         group=shared_eagle(ctx.batch, ctx.heads))


# head kind -> its proposer class, for building one directly (tests, benchmarks); every one
# takes HeadProposer's arguments, EagleProposer also `static`, `store` and `prompt_window`,
# Medusa's and Hydra's also `group` (a batch's SharedHeads)
HEAD_PROPOSERS: dict[str, type[HeadProposer]] = {
    "medusa": MedusaProposer,
    "hydra": HydraProposer,
    "eagle": EagleProposer,
    "eagle3": EagleProposer,
}

ProposerFactory = Callable[[SpecConfig, ProposerContext], Proposer]
# method -> factory(spec, context)
PROPOSERS: dict[str, ProposerFactory] = {
    "draft": _draft,
    "ngram": _ngram,
    "suffix": _suffix,
    "lookahead": _lookahead,
    "layer-skip": _layer_skip,
    "magicdec": _magicdec,
    "qspec": _qspec,
    "early-exit": _early_exit,
    "multi": _multi,
    "medusa": _medusa,
    "hydra": _hydra,
    "eagle": _eagle,
    "eagle3": _eagle,
}

__all__ = ["AUTO_TREE", "HEAD_PROPOSERS", "PROPOSERS", "Draft", "Needs", "Proposer",
           "ProposerContext", "ProposerFactory", "SpecConfig", "tree_budget"]
