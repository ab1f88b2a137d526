"""A bounded token index with flat lookup cost: where has the text's suffix occurred before,
and what followed it. The store behind the `suffix` method (SuffixDecoding).

Owns: `TokenIndex`, the tokens of one or more documents in a ring of `capacity` slots (the
oldest token is evicted first; documents are separated by SEPARATOR, which no match crosses),
and for each n-gram length in ORDERS a hash chain over it, as zlib's LZ77 matcher keeps one:
`heads[n][bucket]`, the slot of the latest n-gram ending of that hash bucket, and
`prev[n][slot]`, how far back the one before it ends. Memory is fixed at construction: 4 bytes
a slot for the tokens, 4 per order for `prev` and 4 per head (their count rounded up to a power
of two), so with (1, 4, 16) 28-40 bytes a token: 28 MB at 2^20 tokens, ~0.36 GB at 10M. A
lookup never scans the text: it hashes the last n tokens, follows at most MAX_WALK chain links
of the longest order that matches, and checks those candidates (their tokens, their match
length back to MAX_MATCH) in one vectorized gather, so its cost does not depend on how many
tokens are indexed.

    ring  ... | a b c d x | SEP | q a b c d y | SEP | a b c d ...        context: ... a b c d
                      ^                     ^
    4-gram "a b c d": heads -> latest end, prev -> the end before it; continuations x, y

What it approximates: the occurrences read are the latest MAX_WALK of the longest indexed order
that matches (not every occurrence of the exact longest match, as a suffix tree would give);
the match length is then measured exactly, up to MAX_MATCH. Hash collisions cost only
wasted links: every candidate's tokens are compared.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = -1  # between documents of the ring; never a token, so never matched
ORDERS = (1, 4, 16)  # n-gram lengths with a hash chain (powers of two: hashes double up)
MAX_MATCH = 64  # longest match measured (arctic-inference's suffix tree depth)
MAX_WALK = 64  # chain links followed per order and lookup: the latest occurrences read
MIN_CAPACITY = 2 * max(ORDERS)  # the smallest index: a chunk's n-gram context stays live
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # a token's hash: (token + 1) * _MIX; buckets: top bits of h * _MIX
_BASE = 0x100000001B3  # an n-gram's hash: sum of its tokens' hashes times _BASE^(distance to end)


@dataclass(frozen=True)
class Match:
    length: int  # tokens of the context's suffix matched (0: none)
    ends: np.ndarray  # [M] absolute positions where it ends, latest first


class TokenIndex:
    """Documents' tokens in a ring of `capacity` slots, their n-grams (ORDERS) hash-chained."""

    def __init__(self, capacity: int, orders: tuple[int, ...] = ORDERS):
        if capacity < 2 * max(orders):
            raise ValueError(f"a suffix index needs at least {2 * max(orders)} tokens, got "
                             f"{capacity}")
        if any(n & (n - 1) for n in orders):
            raise ValueError(f"orders must be powers of two, got {orders}")
        self.capacity, self.orders = capacity, tuple(sorted(orders))
        self.bits = max(1, (capacity - 1).bit_length())
        self.ring = np.full(capacity, SEPARATOR, np.int32)  # [C] slot = position % C
        self.heads = {n: np.full(1 << self.bits, -1, np.int32) for n in self.orders}  # [H] slots
        self.prev = {n: np.zeros(capacity, np.int32) for n in self.orders}  # [C] 0 = none
        self.total = 0  # tokens ever appended (separators included): the next position
        self.start = 0  # where the open document began

    @property
    def held(self) -> int:
        """Tokens in the ring now (separators included): at most capacity."""
        return min(self.total, self.capacity)

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes + sum(a.nbytes for a in (*self.heads.values(),
                                                           *self.prev.values()))

    # --- writing ---------------------------------------------------------------------------

    def add_document(self, tokens: list[int]) -> None:
        """A finished document (a request's output): its own n-grams, then a separator."""
        if not tokens:
            return
        if self.total:
            self.extend([SEPARATOR])
        self.start = self.total
        self.extend(tokens)

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        """Append to the open document (evicting the oldest tokens once the ring is full)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        step = self.capacity // 2  # a chunk never overwrites a slot it wrote, nor its context
        for at in range(0, len(tokens), step):
            self._append(tokens[at:at + step])

    def _append(self, new: np.ndarray) -> None:
        old, n_new = self.total, len(new)
        if not n_new:
            return
        back = min(max(self.orders) - 1, old - max(self.start, old - self.capacity // 2))
        context = self.ring[np.arange(old - back, old) % self.capacity].astype(np.int64)
        window = np.concatenate([context, new])  # [back + L]
        self.ring[np.arange(old, old + n_new) % self.capacity] = new
        self.total = old + n_new
        ends = np.arange(old, old + n_new)  # [L] absolute positions of the new tokens
        for n, hashes in _ngram_hashes(window, self.orders).items():
            h = hashes[back:]  # [L]
            ok = (ends - n + 1 >= self.start) & (new != SEPARATOR)  # within one document
            self._chain(n, ends[ok], _bucket(h[ok], self.bits), old)

    def _chain(self, n: int, ends: np.ndarray, buckets: np.ndarray, old_total: int) -> None:
        """Link positions `ends` [P] (ascending) into order n's chains: each to the latest
        earlier end of its bucket (in this batch, else the head's), heads to the last."""
        if not len(ends):
            return
        order = np.argsort(buckets, kind="stable")
        b, e = buckets[order], ends[order]  # [P] grouped by bucket, ascending within
        first = np.ones(len(b), bool)
        first[1:] = b[1:] != b[:-1]
        before = np.empty(len(b), np.int64)
        before[1:] = e[:-1]
        head = self.heads[n][b[first]].astype(np.int64)  # [G] slots, -1 = none
        before[first] = np.where(head < 0, -1, self._position(head, old_total))
        gap = e - before
        self.prev[n][e % self.capacity] = np.where((before >= 0) & (gap < self.capacity), gap, 0)
        last = np.ones(len(b), bool)
        last[:-1] = b[:-1] != b[1:]
        self.heads[n][b[last]] = e[last] % self.capacity

    def _position(self, slot, total: int):
        """The latest position (< total) a slot holds."""
        return total - 1 - (total - 1 - slot) % self.capacity

    # --- on disk -----------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the index to `path` (.npz) whole, atomically: a reader sees the old file or the
        new one."""
        arrays = {"ring": self.ring, "state": np.array([self.capacity, self.total, self.start]),
                  "orders": np.array(self.orders)}
        for n in self.orders:
            arrays[f"heads{n}"], arrays[f"prev{n}"] = self.heads[n], self.prev[n]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        with partial.open("wb") as f:
            np.savez(f, **arrays)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: Path, capacity: int) -> TokenIndex | None:
        """The index `save` wrote to `path`, if there is one of this capacity and ORDERS."""
        if not path.exists():
            return None
        with np.load(path) as saved:
            size, total, start = (int(x) for x in saved["state"])
            if size != capacity or tuple(saved["orders"].tolist()) != ORDERS:
                return None
            index = cls(capacity)
            index.ring[:] = saved["ring"]
            for n in index.orders:
                index.heads[n][:], index.prev[n][:] = saved[f"heads{n}"], saved[f"prev{n}"]
        index.total, index.start = total, start
        return index

    # --- reading ---------------------------------------------------------------------------

    def lookup(self, context: list[int]) -> Match:
        """The longest suffix of `context` (up to MAX_MATCH tokens) that occurred before with a
        continuation, found through the longest order that matches, and where it ended: of the
        latest MAX_WALK occurrences of that order's n-gram, those matching as far back as any."""
        tail = context[-MAX_MATCH:]
        if not tail or not self.total:
            return Match(0, np.empty(0, np.int64))
        hashes = _query_hashes(tail, self.orders)
        lo = self.total - self.held  # the oldest live position
        for n in reversed(self.orders):
            if n not in hashes:
                continue
            slot = int(self.heads[n][_bucket_one(hashes[n], self.bits)])
            if slot < 0:
                continue
            candidates, p, prev = [], int(self._position(slot, self.total)), self.prev[n]
            while p >= lo and len(candidates) < MAX_WALK:
                candidates.append(p)
                gap = int(prev[p % self.capacity])
                if not gap:
                    break
                p -= gap
            lengths = self._match_lengths(np.array(candidates, np.int64), tail, lo)  # [W]
            follows = self._continues(np.array(candidates, np.int64))
            lengths = np.where(follows, lengths, 0)
            best = int(lengths.max())
            if best >= n:
                return Match(best, np.array(candidates, np.int64)[lengths == best])
        return Match(0, np.empty(0, np.int64))

    def _match_lengths(self, ends: np.ndarray, tail: list[int], lo: int) -> np.ndarray:
        """[W] how many tokens back from each end agree with `tail`'s end (live ones only)."""
        width = len(tail)
        at = ends[:, None] - np.arange(width)[None, :]  # [W, width] positions, backwards
        want = np.asarray(tail[::-1], np.int64)[None, :]  # [1, width]
        same = (self.ring[at % self.capacity] == want) & (at >= lo)
        return np.where(same.all(axis=1), width, same.argmin(axis=1))

    def _continues(self, ends: np.ndarray) -> np.ndarray:
        """[W] whether a token of the same document follows each end."""
        nxt = ends + 1
        return (nxt < self.total) & (self.ring[nxt % self.capacity] != SEPARATOR)

    def continuations(self, ends: np.ndarray, depth: int) -> list[list[int]]:
        """Up to `depth` tokens that followed each end, within its document."""
        at = ends[:, None] + 1 + np.arange(depth)[None, :]  # [M, depth]
        tokens = np.where(at < self.total, self.ring[at % self.capacity], SEPARATOR)
        out = []
        for row in tokens.tolist():
            cut = row.index(SEPARATOR) if SEPARATOR in row else depth
            out.append(row[:cut])
        return out


def _ngram_hashes(window: np.ndarray, orders: tuple[int, ...]) -> dict[int, np.ndarray]:
    """[L] tokens -> order n -> [L] hash of the n-gram ending at each index (garbage where it
    would start before the window: callers mask those), by doubling: h_2m[i] = h_m[i] +
    _BASE^m * h_m[i - m]."""
    h = (window.astype(np.uint64) + np.uint64(1)) * np.uint64(_MIX)  # [L]
    out, m = {}, 1
    while m <= max(orders):
        if m in orders:
            out[m] = h
        shifted = np.zeros_like(h)
        if m < len(h):
            shifted[m:] = h[:-m]
        h = h + shifted * np.uint64(pow(_BASE, m, 1 << 64))
        m *= 2
    return out


def _query_hashes(tail: list[int], orders: tuple[int, ...]) -> dict[int, int]:
    """The hash of `tail`'s last n tokens for each order n it is long enough for (equal to
    _ngram_hashes's)."""
    out, h, power = {}, 0, 1
    for j in range(min(max(orders), len(tail))):
        h = (h + ((tail[-1 - j] + 1) * _MIX & _MASK) * power) & _MASK
        power = power * _BASE & _MASK
        if j + 1 in orders:
            out[j + 1] = h
    return out


def _bucket(h: np.ndarray, bits: int) -> np.ndarray:
    return ((h * np.uint64(_MIX)) >> np.uint64(64 - bits)).astype(np.int64)


def _bucket_one(h: int, bits: int) -> int:
    return (h * _MIX & _MASK) >> (64 - bits)
