"""Structured output under speculation: a grammar's token mask at every verified position.

Owns: `Grammar` (what the output must match: a JSON schema, any JSON object, a regex, or a
Lark / GBNF grammar; frozen, part of a `SamplingConfig`), `GrammarState` (one sequence's
matcher, in step with its emitted tokens) and `tokenizer_for` (the grammar engine's view of a
model's tokenizer, built once per tokenizer). The engine is llguidance (`llguidance` on PyPI):
a Rust wheel with no Python dependencies that takes a Hugging Face `tokenizers` JSON directly,
computes a vocabulary mask in tens of microseconds, and rolls back consumed tokens, which a
verify pass needs (xgrammar, the other choice, pulls in transformers and triton).

Under speculation (the batch step calls these):
1. `cut` trims a draft to its grammar-valid nodes before verification (a chain to its longest
   valid prefix; a tree to the nodes whose whole path is valid), so no row is spent on a token
   the grammar forbids;
2. `masks` gives the allowed tokens at each verified row: row 0 in the committed state, the row
   of node i after consuming the path to it (then rolled back), so position i sees tokens < i
   as if they had been generated;
3. `commit` consumes the tokens the step emitted.
A drafter that declares `Needs.grammar` (the draft model) is handed the state and masks its own
q with `draft_mask`, so its drafts are valid and accepted as often as unconstrained ones.
The mask sets forbidden logits to -inf before any other transform, so the target's processed p
is plain decoding's under the grammar, and rejection sampling against it stays exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

# JSON as Python's json.dumps writes it: ", " and ": ", no other whitespace (a schema's own
# "x-guidance" options win). Free whitespace would let a model pad forever, and every extra
# choice is one more place for a draft to part from the target.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GrammarKind = Literal["json_schema", "json_object", "regex", "grammar", "lark"]


class GrammarError(ValueError):
    """A grammar that does not compile (or an unknown kind)."""


@dataclass(frozen=True)
class Grammar:
    kind: GrammarKind
    source: str = ""  # the schema as JSON text, the regex, or the grammar; "" for json_object

    def compiled(self) -> str:
        """llguidance's grammar definition; GrammarError if the source does not parse."""
        import llguidance

        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                     defaults=JSON_LAYOUT)
            if self.kind == "json_schema":
                json.loads(self.source)  # a clear error for text that is not JSON
                return llguidance.LLMatcher.grammar_from_json_schema(self.source,
                                                                     defaults=JSON_LAYOUT)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "grammar":  # Lark or GBNF, told apart by llguidance
                return llguidance.grammar_from("grammar", self.source)
            if self.kind == "lark":  # Lark as it is (llguidance's extensions: %json)
                return llguidance.LLMatcher.grammar_from_lark(self.source)
        except ValueError as e:
            raise GrammarError(f"the {self.kind} does not parse: {e}") from e
        raise GrammarError(f"unknown grammar kind {self.kind!r}")


_TOKENIZERS: dict[int, tuple[object, object]] = {}  # id(TextTokenizer) -> (it, llguidance's)


def tokenizer_for(tokenizer, vocab_size: int):
    """llguidance's tokenizer for a model's `TextTokenizer` (about a second for a 150k
    vocabulary, so built once per tokenizer), its stop tokens the grammar's end tokens."""
    import llguidance

    key = id(tokenizer)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = (tokenizer, llguidance.LLTokenizer(
            tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
            eos_token=sorted(tokenizer.stop_ids)))
    return _TOKENIZERS[key][1]


def state_for(grammar: Grammar | None, tokenizer, vocab_size: int) -> GrammarState | None:
    """A new sequence's grammar state (None without a grammar); GrammarError if it does not
    compile."""
    if grammar is None:
        return None
    return GrammarState(grammar, tokenizer_for(tokenizer, vocab_size), vocab_size)


class GrammarState:
    """One sequence's grammar matcher, in step with the tokens it emitted."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int):
        """`tokenizer`: from `tokenizer_for`; `vocab_size`: the model's logits' width."""
        import llguidance

        compiled = grammar.compiled()
        error = llguidance.LLMatcher.validate_grammar(compiled, tokenizer)
        if error and not error.startswith("WARNING"):
            raise GrammarError(f"the {grammar.kind} does not compile: {error}")
        self.matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        self.vocab_size, self.words = vocab_size, tokenizer.vocab_size

    def cut(self, tokens: list[int], parents: list[int] | None) -> list[int]:
        """The nodes of a draft (a chain if `parents` is None) to keep: those whose path from
        the root is valid under the grammar, in their order (parents before children). Valid
        as `masks` reads it: consumed by the matcher (a stop token where the grammar ends is
        allowed there but never consumed, so it is cut; the target may still choose it)."""
        if parents is None:
            return list(range(self._consumed(tokens)))
        valid: dict[int, bool] = {}
        for i, p in enumerate(parents):
            if p >= 0 and not valid[p]:
                valid[i] = False
                continue
            path = [i]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = [tokens[j] for j in reversed(path)]
            valid[i] = self._consumed(path) == len(path)
        return [i for i in range(len(tokens)) if valid[i]]

    def _consumed(self, tokens: list[int]) -> int:
        """How many of `tokens` the matcher consumes from its state (which it keeps)."""
        n = self.matcher.try_consume_tokens(tokens)
        self.matcher.rollback(n)
        return n

    def masks(self, tokens: list[int], paths: list[list[int]]) -> torch.Tensor:
        """[1 + N, V] bool, allowed tokens: row 0 now, row i + 1 after the tokens of
        `paths[i]` (node indices into `tokens`, root's child first; each valid)."""
        rows = [self._mask()]
        for path in paths:
            ids = [tokens[j] for j in path]
            if self.matcher.try_consume_tokens(ids) != len(ids):
                raise GrammarError("a draft path the grammar refuses reached verification")
            rows.append(self._mask())
            self.matcher.rollback(len(ids))
        return torch.from_numpy(np.stack(rows))

    def draft_mask(self, drafted: list[int]) -> torch.Tensor | None:
        """[V] bool: the tokens allowed after the committed ones and `drafted` (a drafter's
        next position), or None where nothing may follow (drafting stops there)."""
        consumed = self.matcher.try_consume_tokens(drafted)
        if consumed != len(drafted):
            self.matcher.rollback(consumed)
            return None
        mask = None if self.matcher.is_stopped() else self._mask()
        self.matcher.rollback(len(drafted))
        return None if mask is None or not mask.any() else torch.from_numpy(mask)

    def commit(self, tokens: list[int]) -> None:
        """Consume the emitted tokens; a token the grammar refuses is an engine bug."""
        if not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"the grammar refused an emitted token: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar accepts no more tokens (not even a stop token)."""
        return self.matcher.is_stopped()

    def _mask(self) -> np.ndarray:
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little").astype(bool)  # [32 * ceil(words / 32)]
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, self.words)
        out[:n] = bits[:n]
        return out


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[R, V] logits with every forbidden token at -inf (allowed [R, V] bool)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
