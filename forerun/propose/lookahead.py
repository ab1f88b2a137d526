"""Lookahead decoding (Fu et al., ICML 2024, arXiv 2402.02057): Jacobi iteration over a window of
guessed future tokens, n-grams collected from its trajectories, and the n-grams that start with
the current token verified, all in one target pass and with no draft model.

Owns: `LookaheadProposer`, its window and n-gram pool (`NgramPool`), and the sizing of both
branches. One pass holds, after the pending token x (at position t):

  lookahead     N - 1 levels of W guessed tokens; level j's token i sits at position t + i + j
  branch        (level 0's token 0 is x itself). Token (j, i) sees x, level 0's tokens 1..i and
                its diagonal's (1, i)..(j - 1, i): those are its ancestors in a token tree
                (level 0 a chain from x, each diagonal a chain up from it), which is the paper's
                attention mask (and the sequence ids of llama.cpp's example)
  verification  up to G n-grams of the pool that start with x, N - 1 tokens each: chains from
  branch        x, merged into a trie

Both are nodes of one Draft tree (a lookahead node whose path equals a trie node's is that node:
the same tokens at the same positions compute the same row), so the engine verifies every node
with its usual verifier: greedy takes the target's argmax; sampling is recursive rejection with
one-hot proposals, the paper's sampling verification. Both are lossless: the draft depends only
on tokens before the pass, never on the pass's randomness. A lookahead node the target agrees
with is accepted too (Jacobi decoding's own acceptance).

After the pass the engine shows it the target's argmax at every row (`observe`, Needs.observe):
  collect  each diagonal i (x or level 0's token i, then (1, i) .. (N-2, i), then the argmax
           after (N-2, i)) is an N-gram: its first token keys the pool, the rest is a guess; a
           key keeps its G latest distinct guesses
  shift    the oldest level leaves and the argmaxes after the top level are the new one; every
           level moves left by the tokens accepted (their positions moved on), the gap filled
           with tokens of the text, as the window starts: one level of them, growing by one a
           pass until N - 1
With `pool_from_text` the pool also holds the text's own n-grams (prompt and output).

Sizing: W, N and G are the most. Each pass takes a window w <= W with g = min(G, w) guesses (the
paper's G = W) and, with `auto`, the w with the most expected tokens per second under the
target's measured verify-cost curve: (1 + a(w)) / verify(1 + rows(w)), where a(w) is the
running accepted tokens per pass per log(1 + rows) times log(1 + rows(w)) (the paper finds the
steps shrink linearly in the log of the FLOPs a step spends). w = 0 is a plain step, probed now
and then as the cost policy probes. The engine's k caps the rows a pass adds (a batch's policy
hands each member its share), so it turns itself down where rows are not free.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from forerun.propose.base import Draft, Needs

DEFAULT_WINDOW = 7  # W (the paper's GPU settings are 15, N = 5; a CPU's curve wants fewer)
DEFAULT_NGRAM = 4  # N
DEFAULT_GUESSES = 7  # G
# The gain estimate (accepted tokens a pass per log(1 + rows)): a prior worth PRIOR_PASSES
# passes of 1 token accepted at 10 rows (so a cold window is tried where 5 rows cost < ~1.7 x
# one), evidence discounted by e^-1 per GAIN_MEMORY passes
PRIOR_GAIN = 1.0 / math.log(11.0)
PRIOR_PASSES = 2.0
GAIN_MEMORY = 16.0
# w = 0 learns nothing: every PROBE_EVERY-th plain pass probes the smallest window that adds a
# row; a probe that gains nothing doubles the interval (to MAX_PROBE_EVERY), one that gains
# resets it
PROBE_EVERY = 8
MAX_PROBE_EVERY = 128


@dataclass(frozen=True)
class LookaheadConfig:
    window: int = DEFAULT_WINDOW  # W: the most guessed positions per level
    ngram: int = DEFAULT_NGRAM  # N: the n-grams collected and verified (N - 1 levels)
    guesses: int = DEFAULT_GUESSES  # G: the most n-grams verified a pass (and kept a key)
    auto: bool = True  # size the window each pass from the verify-cost curve (else the most)
    pool_from_text: bool = True  # the pool also holds the prompt's and output's n-grams

    def __post_init__(self):
        if self.window < 1 or self.ngram < 2 or self.guesses < 0:
            raise ValueError(f"lookahead needs window >= 1, ngram >= 2 and guesses >= 0, got "
                             f"{self.window}, {self.ngram}, {self.guesses}")

    @property
    def max_rows(self) -> int:
        """The most rows one pass adds: the full window and G guesses."""
        return rows(self.window, self.ngram - 1, self.guesses, self.ngram)


def rows(w: int, levels: int, guesses: int, n: int) -> int:
    """Rows a pass adds with a window of w over `levels` levels and `guesses` n-grams (at most:
    the trie may merge some): level 0 beyond x, the other levels whole, the guesses."""
    return 0 if w == 0 else (w - 1) + (levels - 1) * w + guesses * (n - 1)


class NgramPool:
    """First token -> its `per_key` latest distinct continuations (tuples of n - 1 tokens)."""

    def __init__(self, n: int, per_key: int):
        self.n, self.per_key = n, per_key
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: Sequence[int]) -> None:
        key, rest = gram[0], tuple(gram[1:])
        held = self.grams.setdefault(key, [])
        if rest in held:
            held.remove(rest)
        held.insert(0, rest)
        del held[self.per_key:]

    def add_text(self, tokens: Sequence[int], start: int) -> None:
        """The n-grams of `tokens` that end at or after index `start`."""
        for i in range(max(0, start - self.n + 1), len(tokens) - self.n + 1):
            self.add(tokens[i:i + self.n])

    def guesses(self, key: int, g: int) -> list[tuple[int, ...]]:
        return self.grams.get(key, [])[:g]


class _Trie:
    """Draft nodes by (parent, token): a path built twice is one node."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._at: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int) -> int:
        node = self._at.get((parent, token))
        if node is None:
            node = self._at[(parent, token)] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return node


@dataclass
class _Pass:
    """What a draft was made of, for `observe`."""

    draft: Draft
    root: int  # x, the pending token
    nodes: list[list[int]]  # [levels][w] node of (j, i); -1 = x
    rows: int


@dataclass
class LookaheadProposer:
    cfg: LookaheadConfig
    curve: Callable[[float], float] | None = None  # target seconds per pass of n rows (auto)
    name: str = "lookahead"
    runtime: ClassVar[None] = None  # no model: its guesses ride on the target's pass
    group: ClassVar[None] = None  # drafts alone
    needs: ClassVar[Needs] = Needs(observe=True)  # the target's argmax at every row it adds

    pool: NgramPool = field(init=False)
    levels: list[list[int]] = field(default_factory=list)  # [1..N-1][W], the oldest first
    text: list[int] = field(default_factory=list)  # the sequence as far as it has seen it
    _rng: random.Random = field(default_factory=lambda: random.Random(0))  # fills (never the
    # sequence's generator: the draft must not touch the verifier's randomness)
    _made: _Pass | None = None
    _gain: float = 0.0  # discounted accepted tokens / log(1 + rows), summed
    _passes: float = 0.0  # discounted passes that added rows
    _plain: int = 0
    _probe_every: int = PROBE_EVERY
    _probing: bool = False

    def __post_init__(self):
        self.pool = NgramPool(self.cfg.ngram, max(1, self.cfg.guesses))

    # --- the protocol --------------------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> None:
        self.pool = NgramPool(self.cfg.ngram, max(1, self.cfg.guesses))
        self.text, self._made = [], None
        self._sync(prompt)
        self.levels = [self._fill(self.cfg.window)]

    def propose(self, tokens, k, sampling, generator) -> Draft:
        seen = len(self.text)
        if seen > len(tokens) or (seen and tokens[seen - 1] != self.text[-1]):
            self.prefill(tokens[:-1])  # not this sequence's continuation: start anew
        self._sync(tokens)
        self._made = None
        w = self._window(k)
        if w == 0:
            return Draft.empty()
        x, trie = tokens[-1], _Trie()
        for guess in self.pool.guesses(x, min(self.cfg.guesses, w)):
            at = -1
            for t in guess:
                at = trie.add(at, t)
        nodes = [[-1] * w for _ in self.levels]  # [levels][w]
        for i in range(1, w):
            nodes[0][i] = trie.add(nodes[0][i - 1], self.levels[0][i])
        for j in range(1, len(self.levels)):
            for i in range(w):
                nodes[j][i] = trie.add(nodes[j - 1][i], self.levels[j][i])
        chain = trie.parents == list(range(-1, len(trie.parents) - 1))
        draft = Draft(torch.tensor(trie.tokens, dtype=torch.long), None,
                      None if chain else torch.tensor(trie.parents, dtype=torch.long))
        self._made = _Pass(draft, x, nodes, len(trie.tokens))
        return draft

    def commit(self, num_final: int) -> None:
        pass  # its state moves on in `observe`; it keeps nothing of rejected tokens

    def observe(self, draft: Draft, best: list[int], path: list[int]) -> None:
        made, self._made = self._made, None
        if made is None:
            return
        self._learn(made.rows, len(path))
        width, full = len(made.nodes[0]), len(self.levels) == self.cfg.ngram - 1
        top = self.levels[-1]
        if draft is made.draft:  # (else the engine cut it: nothing seen, the guesses stay)
            out = [best[made.nodes[-1][i] + 1] for i in range(width)]  # after (top, i)
            if full:
                for i in range(width):
                    first = made.root if i == 0 else self.levels[0][i]
                    self.pool.add([first, *(level[i] for level in self.levels[1:]), out[i]])
            top = out + top[width:]
        levels = [*self.levels[1:], top] if full else [*self.levels, top]
        shift = len(path)
        if shift:  # each position moved on by the tokens accepted
            levels = [level[shift:] + self._fill(shift) for level in levels]
        self.levels = levels

    # --- inside --------------------------------------------------------------------------------

    def _sync(self, tokens: list[int]) -> None:
        start = len(self.text)
        self.text.extend(tokens[start:])
        if self.cfg.pool_from_text and self.cfg.guesses:
            self.pool.add_text(self.text, start)

    def _fill(self, n: int) -> list[int]:
        """n tokens of the text (the window's guesses before it has any)."""
        return [self._rng.choice(self.text) if self.text else 0 for _ in range(n)]

    def _rows(self) -> list[int]:
        """Rows a pass adds with each window w = 0..W, now (the levels filled, x's guesses)."""
        x = self.text[-1] if self.text else -1
        held = len(self.pool.guesses(x, self.cfg.guesses))
        return [rows(w, len(self.levels), min(held, w), self.cfg.ngram)
                for w in range(self.cfg.window + 1)]

    def _window(self, k: int) -> int:
        """This pass's w: the largest that fits k, or with `auto` the best under the curve."""
        added = self._rows()  # [W + 1]
        fits = [w for w, n in enumerate(added) if n <= k]
        if not self.cfg.auto or self.curve is None:
            return fits[-1]
        gain = (self._gain + PRIOR_GAIN * PRIOR_PASSES) / (self._passes + PRIOR_PASSES)
        rate = [(1 + gain * math.log(1 + added[w])) / self.curve(1 + added[w]) for w in fits]
        w = fits[max(range(len(fits)), key=rate.__getitem__)]
        self._plain = self._plain + 1 if w == 0 else 0
        adds = [w for w in fits if added[w]]  # windows that add a row
        self._probing = w == 0 and self._plain >= self._probe_every and bool(adds)
        if self._probing:
            self._plain = 0
            return adds[0]
        return w

    def _learn(self, added: int, accepted: int) -> None:
        if self._probing:
            grown = min(2 * self._probe_every, MAX_PROBE_EVERY)
            self._probe_every = PROBE_EVERY if accepted else grown
            self._probing = False
        if added:
            keep = math.exp(-1 / GAIN_MEMORY)
            self._gain = keep * self._gain + accepted / math.log(1 + added)
            self._passes = keep * self._passes + 1
