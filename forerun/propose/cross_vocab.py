"""The bridge between a target and a draft model whose tokenizers differ.

Owns: `VocabBridge`, what the draft method needs to draft for a target of another vocabulary,
built once per pair of tokenizers (`vocab_bridge`, cached) from text alone, never from weights:

- every token's bytes, for both tokenizers: byte-level BPE (Qwen, SmolLM2, Llama 3) maps its
  token strings through the GPT-2 byte alphabet, SentencePiece ("▁" for a space, "<0x0A>"
  byte-fallback tokens) through its own convention, added and special tokens are their text.
  The text of any token sequence is then the concatenation of its tokens' bytes, exactly, even
  where a token ends inside a UTF-8 character;
- the text bridge: text -> the draft's tokens (the draft's context, `to_draft`), text -> the
  target's tokens (a greedy draft's proposal, `to_target`), and the draft's tokens that extend
  a given text (`extensions`: token healing at the context's end);
- the token-level intersection (TLI, Timor et al., ICML 2025): the target ids whose token the
  draft's vocabulary holds with the same bytes (special tokens matched to special tokens by
  their text, and the draft's end-of-sequence token to the target's), one draft id for each.
  `scatter` lays a draft row of logits [V_draft] onto the target's vocabulary [V], -inf outside
  the intersection: softmax of that is the draft's q restricted to the shared tokens and
  renormalised, which drafts only tokens both sides can name, one draft token per target token,
  and under which standard rejection sampling is exact for the target.

Never runs a model and never decides acceptance: the target verifies every drafted token, so
nothing here can change the output, only how often a draft is accepted.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cache

import torch
from tokenizers import decoders, pre_tokenizers

from forerun.models.catalog import ModelError
from forerun.models.tokenizer import TextTokenizer

# a pair that shares fewer of the draft's tokens than this is refused: its restricted draft
# distribution (sampling) would leave out most of what the draft says
MIN_SHARED_FRACTION = 0.1
PROBE_TEXT = "Hello, world!\n  def f(x):\n\treturn [x + 1, 'é', 42]  # ok\n"  # must round-trip
SENTENCEPIECE_SPACE = "\u2581"
BRIDGE_CACHE_SIZE = 8  # pairs kept (an engine's forks and a chat's reloads reuse theirs)
UTF8_CONTINUATION, UTF8_CONTINUATION_MASK = 0x80, 0xC0  # 0b10xxxxxx: inside a character


def token_bytes(tok: TextTokenizer, size: int) -> tuple[list[bytes], frozenset[int]]:
    """Each id's bytes (b"" where the id names no token) for ids < `size`, and the ids of
    special tokens (their bytes are their text)."""
    hf = tok.tokenizer
    added = hf.get_added_tokens_decoder()  # id -> AddedToken
    byte_level = isinstance(hf.decoder, decoders.ByteLevel)
    byte_of = {c: b for b, c in enumerate(byte_alphabet())}
    table = [b""] * size
    for text, i in hf.get_vocab(with_added_tokens=True).items():
        if i >= size:
            continue
        if i in added:
            table[i] = added[i].content.encode()
        elif byte_level:
            if any(c not in byte_of for c in text):
                raise ModelError(f"token {i} ({text!r}) is not byte-level BPE")
            table[i] = bytes(byte_of[c] for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            table[i] = bytes([int(text[3:5], 16)])  # SentencePiece byte fallback
        else:
            table[i] = text.replace(SENTENCEPIECE_SPACE, " ").encode()
    return table, frozenset(i for i, a in added.items() if a.special and i < size)


@cache
def byte_alphabet() -> list[str]:
    """The GPT-2 byte-to-character map: character c stands for byte byte_alphabet().index(c)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    assert set(chars) == set(pre_tokenizers.ByteLevel.alphabet())
    return chars


@dataclass(frozen=True)
class VocabBridge:
    """A target and a draft tokenizer, and the maps between them (see the module docstring)."""

    target: TextTokenizer
    draft: TextTokenizer
    target_bytes: list[bytes]  # [V] each target id's bytes
    draft_bytes: list[bytes]  # [V_draft] each draft id's bytes
    shared_target: torch.Tensor  # [S] int64 target ids of the intersection
    shared_draft: torch.Tensor  # [S] int64 the draft id of each, in the same order
    draft_of: dict[int, int]  # target id -> draft id, over the intersection
    draft_stops: frozenset[int]  # the draft's end-of-sequence ids
    target_eos: int | None  # the target's end-of-sequence id (where a draft's stop maps to)
    draft_bos: list[int]  # what the draft's tokens of a text start with (its BOS, if it adds one)
    draft_special: frozenset[int]  # the draft's special tokens (never healed)
    by_prefix: tuple[list[bytes], list[int]]  # the draft's tokens' bytes, sorted, and their ids
    _extensions: dict[bytes, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def target_size(self) -> int:
        return len(self.target_bytes)

    def text(self, target_ids: list[int]) -> bytes:
        """The bytes of a target token sequence."""
        return b"".join(self.target_bytes[t] for t in target_ids)

    def to_draft(self, data: bytes) -> list[int] | None:
        """The draft's tokens for this text (no BOS: `draft_bos`); None where the text ends
        inside a UTF-8 character (a target token split it: wait for the rest)."""
        text = _complete(data)
        return None if text is None else self.draft.encode(text, add_special=False)

    def to_target(self, data: bytes) -> list[int]:
        """The target's tokens for the longest prefix of this text that ends on a character."""
        end = len(data)
        while end > 0 and _complete(data[:end]) is None:
            end -= 1
        return self.target.tokenizer.encode(data[:end].decode(), add_special_tokens=False).ids

    def extensions(self, prefix: bytes) -> torch.Tensor:
        """The draft ids whose bytes start with `prefix` [E] (token healing: the draft
        re-chooses the context's last token among those), cached."""
        if prefix not in self._extensions:
            keys, ids = self.by_prefix
            lo = hi = bisect_left(keys, prefix)
            while hi < len(keys) and keys[hi].startswith(prefix):
                hi += 1
            self._extensions[prefix] = torch.tensor(ids[lo:hi], dtype=torch.long)
        return self._extensions[prefix]

    def scatter(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_draft] -> [..., V]: each shared token's logit at its target id,
        -inf elsewhere (softmax: the draft's q restricted to the intersection, renormalised)."""
        out = logits.new_full((*logits.shape[:-1], self.target_size), float("-inf"))
        out[..., self.shared_target] = logits[..., self.shared_draft]
        return out


def _complete(data: bytes) -> str | None:
    """`data` as text, or None where it ends inside a character (or is not UTF-8)."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


_BRIDGES: dict[tuple[int, int, int], VocabBridge] = {}  # (id target, id draft, V) -> bridge;
# a bridge holds both tokenizers, so their ids are not reused while it is kept


def vocab_bridge(target: TextTokenizer, draft: TextTokenizer, target_size: int,
                 draft_size: int | None = None) -> VocabBridge | None:
    """The bridge from `draft` to `target` (vocabularies of `target_size` and `draft_size`
    ids, the models' own sizes), or None where the two tokenizers agree on every token/id pair
    (the draft then drafts target ids directly). Raises ModelError where a tokenizer's tokens
    cannot be read as text, or the pair shares too few tokens."""
    if target.vocab == draft.vocab:
        return None
    key = (id(target), id(draft), target_size)
    if key not in _BRIDGES:
        if len(_BRIDGES) >= BRIDGE_CACHE_SIZE:
            _BRIDGES.pop(next(iter(_BRIDGES)))
        _BRIDGES[key] = _build(target, draft, target_size,
                               draft_size or draft.tokenizer.get_vocab_size(with_added_tokens=True))
    return _BRIDGES[key]


def _build(target: TextTokenizer, draft: TextTokenizer, target_size: int,
           draft_size: int) -> VocabBridge:
    target_bytes, target_special = token_bytes(target, target_size)
    draft_bytes, draft_special = token_bytes(draft, draft_size)
    for name, tok, table in (("target", target, target_bytes), ("draft", draft, draft_bytes)):
        if isinstance(tok.tokenizer.decoder, decoders.ByteLevel):
            continue  # its tokens' bytes are the byte alphabet's, by construction
        ids = tok.encode(PROBE_TEXT, add_special=False)
        if b"".join(table[i] if i < len(table) else b"" for i in ids) != PROBE_TEXT.encode():
            raise ModelError(f"the {name}'s tokenizer does not give its tokens' text back "
                             "(forerun reads byte-level BPE and SentencePiece tokenizers); a "
                             "draft of another vocabulary needs both")
    by_bytes: dict[tuple[bytes, bool], int] = {}  # (bytes, special) -> the draft's first id
    for i, b in enumerate(draft_bytes):
        if b:
            by_bytes.setdefault((b, i in draft_special), i)
    draft_of = {t: by_bytes[(b, t in target_special)] for t, b in enumerate(target_bytes)
                if (b, t in target_special) in by_bytes}
    target_eos = _id(target, target.eos_token)
    draft_eos, draft_bos = _id(draft, draft.eos_token), _id(draft, draft.bos_token)
    if target_eos is not None and draft_eos is not None and draft_eos not in draft_of.values():
        draft_of.setdefault(target_eos, draft_eos)  # the end of a reply, whatever its name
    if len(draft_of) < MIN_SHARED_FRACTION * draft_size:
        raise ModelError(f"the draft and target vocabularies share {len(draft_of)} tokens, "
                         f"fewer than {MIN_SHARED_FRACTION:.0%} of the draft's {draft_size}: "
                         "pick a draft whose tokenizer is closer to the target's, or use "
                         "--method ngram")
    shared = sorted(draft_of.items())
    return VocabBridge(target, draft, target_bytes, draft_bytes,
                       torch.tensor([t for t, _ in shared], dtype=torch.long),
                       torch.tensor([d for _, d in shared], dtype=torch.long), draft_of,
                       frozenset(draft.stop_ids) | ({draft_eos} if draft_eos is not None
                                                    else frozenset()), target_eos,
                       [draft_bos] if draft.add_bos and draft_bos is not None else [],
                       draft_special, _sorted_by_bytes(draft_bytes, draft_special))


def _sorted_by_bytes(table: list[bytes], special: frozenset[int]) -> tuple[list[bytes], list[int]]:
    """The ordinary tokens' bytes in sorted order, and their ids (prefix lookups by bisection)."""
    order = sorted((b, i) for i, b in enumerate(table) if b and i not in special)
    return [b for b, _ in order], [i for _, i in order]


def _id(tok: TextTokenizer, text: str | None) -> int | None:
    return None if text is None else tok.tokenizer.token_to_id(text)


def char_start(data: bytes, end: int) -> int:
    """The largest offset <= `end` where a character starts in `data`."""
    while 0 < end < len(data) and data[end] & UTF8_CONTINUATION_MASK == UTF8_CONTINUATION:
        end -= 1
    return end
