"""Draft-model speculation: a smaller model with the same tokenizer proposes k tokens
autoregressively, sampled from its own distribution q under the same sampling settings
(penalties and logit bias included, with the history each drafted position has).

Owns: the draft model's KV cache bookkeeping. Invariant: the draft cache holds the first
`runtime.length` tokens of the sequence; `propose` feeds whatever is missing (the pending token,
or two after a fully accepted draft), then one token per step; `commit` truncates the cache to
the tokens that verification kept, so rejected drafts cost nothing to undo.

`RootRow` keeps the draft's logits after the sequence it last drafted from: a second draft
from the same sequence (multi's k chains, the cache cut back between them) draws its first
token from that same row instead of recomputing it. Recomputed, the row would come from a pass
over fewer tokens and differ by rounding (bf16), and the k root candidates would not be i.i.d.
draws from one q, as SpecTr's verifier needs.
"""

from __future__ import annotations

import torch

from forerun.grammar import GrammarState, apply_masks
from forerun.processors import process_row
from forerun.propose.base import Draft, Needs
from forerun.runtime.base import Runtime
from forerun.sampling import logits_to_probs, sample


class RootRow:
    """The draft's logits [V] after one sequence: reused by every draft from that sequence."""

    def __init__(self):
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # [V]

    def get(self, tokens: list[int]) -> torch.Tensor | None:
        """The row after `tokens`, if it is the one kept."""
        return self.logits if self.logits is not None and tokens == self.tokens else None

    def keep(self, tokens: list[int], logits: torch.Tensor) -> None:
        # a copy: a runtime may hand out a view of an output buffer its next pass overwrites
        self.tokens, self.logits = list(tokens), logits.clone()


class DraftModelProposer:
    name = "draft"
    group = None  # drafts alone, through propose
    needs = Needs(grammar=True)  # the tokens alone (its own model and cache); masks its q

    def __init__(self, runtime: Runtime, target_vocab_size: int):
        self.runtime, self.vocab_size = runtime, target_vocab_size
        self.prompt_length = 0  # where the sequence's output starts (the penalties' history)
        self.grammar: GrammarState | None = None  # the sequence's, under structured output
        self.root = RootRow()

    def constrain(self, grammar: GrammarState) -> None:
        self.grammar = grammar

    def prefill(self, prompt: list[int]) -> None:
        self.prompt_length = len(prompt)
        self.root = RootRow()
        self.runtime.truncate(0)
        if len(prompt) > 1:
            self.runtime.forward(torch.tensor(prompt[:-1]), last_only=True)

    def propose(self, tokens, k, sampling, generator) -> Draft:
        if k == 0:
            return Draft.empty()
        missing = torch.tensor(tokens[self.runtime.length:], dtype=torch.long)  # [M >= 0]
        known = self.root.get(tokens)  # [V] the row after `tokens`, if drafted from before
        drafted, q = [], []
        for depth in range(k):
            if known is None:
                logits = self.runtime.forward(missing, last_only=True).logits[-1]  # [V_draft]
                logits = self._to_target_vocab(logits)  # [V]
                missing = missing[:0]
                if depth == 0:
                    self.root.keep(tokens, logits)
            else:
                logits, known = known, None
            if sampling.processing.active:  # q shaped as the target's p is
                logits = process_row(logits, sampling.processing,
                                     [*tokens, *(int(t) for t in drafted)], self.prompt_length)
            if self.grammar is not None:  # only tokens the grammar allows there
                allowed = self.grammar.draft_mask([int(t) for t in drafted])  # [V]
                if allowed is None:
                    break
                logits = apply_masks(logits[None], allowed[None])[0]
            if sampling.greedy:  # its one-hot row's token; q = None says just that
                token = logits.argmax(-1)
            else:
                probs = logits_to_probs(logits, sampling)  # [V]
                token = sample(probs, generator)
                q.append(probs)
            drafted.append(token)
            missing = torch.cat([missing, token.view(1)])  # [M + 1] (M > 0 after a kept row)
        if not drafted:
            return Draft.empty()
        return Draft(torch.stack(drafted), torch.stack(q) if q else None)  # [K], [K, V]

    def commit(self, num_final: int) -> None:
        self.runtime.truncate(min(self.runtime.length, num_final))

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad or cut the draft's logits to the target's vocabulary size (same tokenizer)."""
        size = logits.shape[-1]
        if size == self.vocab_size:
            return logits
        if size > self.vocab_size:
            return logits[: self.vocab_size]
        return torch.cat([logits, logits.new_full((self.vocab_size - size,), float("-inf"))])
