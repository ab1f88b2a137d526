"""The Proposer protocol and the Draft it returns.

Owns: the seam every drafting method plugs into. A proposer sees the whole token sequence so far
(prompt + output), proposes up to k next tokens, and is told after verification how much of the
sequence is final so it can roll back any state (a KV cache) built on rejected tokens.
What a proposer needs beyond the tokens (target features, extra verify rows, a store kept
across its sequence's proposers, its output once finished) it declares in `needs`, a `Needs`
record the engine reads; nothing probes a proposer for optional attributes. A factory in
`forerun.propose.PROPOSERS` builds one from the speculation config and a `ProposerContext`, the
models and stores it may use.
Also `AcceptanceEstimate`, the running per-token acceptance that prices drafts (the cost length
policy, the lookup branch of a head's tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from forerun.runtime.base import Resume, Runtime
from forerun.sampling import SamplingConfig

if TYPE_CHECKING:
    from forerun.heads import Heads
    from forerun.models.tokenizer import TextTokenizer
    from forerun.propose.cross_vocab import VocabBridge

# the ProposerContext.batch key of the batch's target runtime, where it resumes rows
# (capabilities.resume_rows): a drafter that writes the target's cache (early exit,
# magicdec's self drafter) drafts in its member's region of that runtime's pool
BATCH_TARGET = "batch-target"


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [K] int64; K may be 0 (nothing to propose: a plain decoding step)
    q: torch.Tensor | None = None  # [K, V] draft probabilities; None = deterministic drafter
    parents: torch.Tensor | None = None  # [K] parent per node (-1 = root): a tree; see tree.py
    # the verify pass's first rows (pending token, nodes) whose lower layers the drafter
    # computed in the target's own cache (early exit; its Needs.resume): they start there
    resume: Resume | None = None

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.empty(0, dtype=torch.long))

    def fit(self, room: int) -> Draft:
        """At most `room` nodes: the first ones, which (parents first) still form a tree."""
        if len(self.tokens) <= room:
            return self
        resume = self.resume
        if resume is not None and resume.rows > room + 1:  # the pending token + room nodes
            resume = Resume(resume.layer, resume.hidden[:room + 1])
        return Draft(self.tokens[:room], None if self.q is None else self.q[:room],
                     None if self.parents is None else self.parents[:room], resume)


@dataclass(frozen=True)
class Needs:
    """What a drafter needs of the engine beyond the token sequence (the default: nothing)."""

    hidden_layers: tuple[int, ...] = ()  # target layers it drafts from (-1 = final normed),
    # fed through `feed` for every token that enters the target's cache (a FeatureProposer)
    prompt_features: bool = False  # it reads the prompt's features after prefill; False where
    # a hidden row costs an LM-head row (llama.cpp): prefill is plain's, drafting starts later
    prompt_rows: int = 0  # ... of the prompt's last this many rows only (0 = every row)
    extra_rows: int = 0  # rows it adds to each verify pass beyond its draft; the engine keeps
    # context room for them (a joined drafter's; Lookahead's rows are nodes of its draft)
    shared_store: bool = False  # keeps state in ProposerContext.stores (across its proposers)
    grammar: bool = False  # drafts under the sequence's grammar: handed its state through
    # `constrain` at admission (structured output), it masks its own q
    archive: bool = False  # is handed its sequence's output through `archive` when the
    # sequence leaves the engine (the suffix method's index of earlier outputs)
    observe: bool = False  # is shown the target's argmax at every row of its verified draft
    # through `observe` (Lookahead's Jacobi window learns from the rows it added)
    teach: bool = False  # is shown the target's raw logits at every row of its verified
    # draft through `teach` (online distillation: `forerun.train.online`)
    resume: bool = False  # drafts with the target's own first layers in the target's own
    # cache, its chains carrying `Draft.resume` (early exit): the runtime must resume rows
    # (capabilities.resume_rows)
    target_region: bool = False  # a batch member drafting in its sequence's region of the
    # target's pool (early exit, magicdec's self drafter): told the region through `bind` at
    # each admission; it keeps no cache of its own (preemptible as a plain member)
    remote: bool = False  # drafts in a process of its own (--disaggregate): nothing of its
    # sequence lives in this process's pools, so its member may be preempted like a plain one
    tree_verifier: str = "rrs"  # how its sampled trees are verified: a key of
    # forerun.verify_spectr.TREE_VERIFIERS ("spectr": siblings are i.i.d. draws from one q)

    def hidden_from(self, prompt_len: int) -> int:
        """The first prompt row whose features it reads (the target returns those only)."""
        return max(0, prompt_len - self.prompt_rows) if self.prompt_rows else 0


@dataclass(frozen=True)
class ProposerContext:
    """What a factory in PROPOSERS may build a proposer from: the models and the stores."""

    target: Runtime
    draft: Runtime | None = None  # a draft model's runtime (method draft)
    heads: Heads | None = None  # trained heads for the target (medusa, hydra, eagle, eagle3)
    tokenizer: TextTokenizer | None = None
    # state kept across the proposers built for one sequence, by name (an EAGLE head's cache
    # and recorded graphs); the engine that builds them owns it (a drafter's Needs.shared_store)
    stores: dict[str, Any] = field(default_factory=dict)
    capacity: int | None = None  # the most tokens its sequence will hold (a batch member's
    # prompt + budget + one pass); None = the target's context. Sizes a drafter's own cache
    # state shared by the proposers of one batch's members, by name (the batch's Medusa or Hydra
    # heads, which compute every member's root in one call); the batch that builds them owns
    # it. None = a sequence decoded alone
    batch: dict[str, Any] | None = None
    # state shared by every proposer an engine (and its forks, a server's requests) builds, by
    # name: the suffix method's index of earlier outputs; the Engine owns it. None = nothing
    # outlives its sequence
    shared: dict[str, Any] | None = None
    # where the draft's tokenizer is not the target's: the maps between them (the draft method
    # then drafts through forerun.propose.cross_draft); None = one vocabulary
    bridge: VocabBridge | None = None


@dataclass
class AcceptanceEstimate:
    """P(a draft token is accepted): a prior worth `prior_trials` positions at `prior`, then
    evidence discounted by e^-1 per `memory` newer positions (it follows the text)."""

    prior: float
    prior_trials: float
    memory: float
    accepted: float = 0.0  # discounted accepted draft positions
    trials: float = 0.0  # discounted observed draft positions

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_trials) / (self.trials + self.prior_trials)

    def age(self, positions: float = 1.0) -> None:
        """Discount the evidence as if `positions` newer ones had been seen, without seeing
        them: the estimate drifts back toward its prior (a drafter at rest)."""
        keep = math.exp(-positions / self.memory)
        self.accepted *= keep
        self.trials *= keep

    def observe(self, accepted: int, drafted: int) -> None:
        """`accepted` of `drafted` positions, in order: a rejection at position j shows
        positions < j accepted and j rejected; later positions were never tested."""
        observed = accepted + (accepted < drafted)
        keep = math.exp(-observed / self.memory)
        self.accepted = keep * self.accepted + accepted
        self.trials = keep * self.trials + observed


class Proposer(Protocol):
    name: str
    needs: Needs  # what it needs of the engine (target features, extra verify rows)
    runtime: Runtime | None  # the model it runs once per drafted token; None = free to draft
    # the drafter that drafts for this proposer and others in one pass (a batch's shared draft
    # model); None = it drafts alone, through `propose`
    group: BatchDrafter | None

    def prefill(self, prompt: list[int]) -> None:
        """Start a new sequence with this prompt."""
        ...

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig,
                generator: torch.Generator) -> Draft:
        """Up to k tokens to follow `tokens`; sampled from q when q is returned."""
        ...

    def commit(self, num_final: int) -> None:
        """The first `num_final` tokens of the sequence are final; forget anything after them."""
        ...


class ConstrainedProposer(Proposer, Protocol):
    """A proposer that drafts under the sequence's grammar (`needs.grammar`)."""

    def constrain(self, grammar) -> None:
        """The sequence's `forerun.grammar.GrammarState`, at admission: each drafted position
        masks q with `grammar.draft_mask(drafted so far)`."""
        ...


class ArchivingProposer(Proposer, Protocol):
    """A proposer that learns from finished sequences (`needs.archive`)."""

    def archive(self, output: list[int]) -> None:
        """Its sequence's output (the tokens emitted after the prompt), as it leaves the
        engine: finished, stopped, dropped or failed."""
        ...


class ObservingProposer(Proposer, Protocol):
    """A proposer that learns from the target's choices on its whole draft (`needs.observe`)."""

    def observe(self, draft: Draft, best: list[int], path: list[int]) -> None:
        """After a verify pass of `draft` (the Draft verified: the engine may have cut the one
        it returned): the target's argmax at each of its rows, best[0] after the pending token
        and best[i + 1] after node i (under the sequence's processors and grammar), and the
        accepted nodes `path`."""
        ...


class TeachingProposer(Proposer, Protocol):
    """A proposer that learns from the target's distributions on its draft (`needs.teach`)."""

    def teach(self, draft: Draft, logits: torch.Tensor, path: list[int]) -> None:
        """After a verify pass of `draft`: the target's raw logits at its rows [1 + nodes, V]
        (row 0 after the pending token, row i + 1 after node i) and the accepted nodes
        `path`."""
        ...


class FeatureProposer(Proposer, Protocol):
    """A proposer that drafts from the target's own hidden states (Medusa, Hydra, EAGLE): its
    `needs.hidden_layers` name them."""

    def feed(self, hidden: dict[int, torch.Tensor]) -> None:
        """The target's features (layer -> [n, D]) of the n tokens that just entered its cache:
        the prompt after prefill (if `needs.prompt_features`; its last `needs.prompt_rows`
        rows, or all of them, of which it keeps those), the pending token and the accepted
        path after each verify. Invariant: the proposer has been fed every token of the
        sequence but the last (the prompt's only if `needs.prompt_features`)."""
        ...


class ResumingProposer(Proposer, Protocol):
    """A proposer that drafts in its sequence's target cache (`needs.target_region`: early
    exit, magicdec's self drafter)."""

    def bind(self, seq: int) -> None:
        """A batch member's, at each admission: its cache is region `seq` of the batch
        runtime's pool (the next drafts write there, past the member's committed tokens)."""
        ...


@dataclass
class DraftRequest:
    """What one member of a batch asks of a shared drafter's round."""

    proposer: Proposer
    tokens: list[int]  # the sequence so far (prompt + emitted + pending)
    k: int
    sampling: SamplingConfig
    generator: torch.Generator


class BatchDrafter(Protocol):
    """Drafts for several sequences at once (their proposers name it as their `group`)."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One Draft per request, in order; request i's tokens sampled from its own q with its
        own generator."""
        ...

    def backlog(self, proposer: Proposer, tokens: list[int]) -> int:
        """Tokens of the proposer's sequence `tokens` that its next draft must first feed the
        drafter's model (a newcomer's prompt, or what it decoded while it drafted nothing),
        beyond the one a round feeds anyway; 0 where the drafter reads the target's features.
        The batch's cost policy prices that catch-up before letting the member draft."""
        ...

    def release(self, proposer: Proposer) -> None:
        """Forget the proposer's sequence and free what it held."""
        ...
