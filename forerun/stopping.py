"""When generation stops: stop tokens, the token budget, the context window and stop strings.

Owns: the checks both decoders share so that plain and speculative decoding stop at exactly the
same token. A stop token ends generation and is not emitted (as in the OpenAI API). Stop strings
are matched on the decoded text by `StopStrings`, which also says how much of the text's tail
must be held back because it may be the start of a stop string; `TextOut` is the text side of
one generation (incremental detokenizing, stop strings, the held-back tail) for every caller.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from forerun.models.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    from forerun.models.tokenizer import TextTokenizer


class ContextError(ValueError):
    """The prompt does not fit in the context window."""


def check_prompt(prompt: list[int], capacity: int) -> None:
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) + 1 > capacity:
        raise ContextError(f"the prompt has {len(prompt)} tokens but the context holds "
                           f"{capacity}; shorten it or raise --context")


def cut(tokens: list[int], stop_ids: Collection[int], budget: int, room: int
        ) -> tuple[list[int], str | None]:
    """Emit tokens up to the first stop token, `budget` tokens or `room` slots of context."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i], "stop"
        if i + 1 >= budget or i + 1 >= room:
            return tokens[: i + 1], "length"
    return tokens, None


class StopStrings:
    """Incremental matching of stop strings on a growing text (Knuth-Morris-Pratt, one automaton
    per stop string).

    Each stop string keeps the length of its longest prefix that is a suffix of the text fed so
    far. Feeding c characters costs O(c) amortized per stop string (a character moves the state
    forward by at most one, and each fall-back along the failure links undoes one such move), so
    a generation costs O(text + sum of stop lengths) however long the stop strings are; checking
    every prefix of every stop string at each step would cost O(stop length ** 2) per step.
    Once `feed` has found a stop string the generation ends, and the matcher is spent.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)  # matched prefix length of each stop string
        self.length = 0  # characters fed

    def feed(self, new: str) -> int | None:
        """Append `new` to the text; -> where the earliest stop string that ends inside `new`
        begins (an index into the whole text), or None."""
        hit = None
        for j, (stop, fail) in enumerate(zip(self.stops, self.fail, strict=True)):
            state = self.state[j]
            for i, c in enumerate(new):
                while state and stop[state] != c:
                    state = fail[state - 1]
                if stop[state] == c:
                    state += 1
                if state == len(stop):
                    start = self.length + i + 1 - len(stop)
                    hit = start if hit is None else min(hit, start)
                    state = fail[state - 1]
                    break  # later matches of this stop string begin later
            self.state[j] = state
        self.length += len(new)
        return hit

    @property
    def held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max(self.state, default=0)


class TextOut:
    """One generation's text: push each step's tokens, get the text that is safe to send (a
    tail that may begin a stop string is held back until it is decided) and whether a stop
    string ended the generation (the text then ends just before it)."""

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...] = ()):
        self.decoder, self.stops = IncrementalDecoder(tokenizer), StopStrings(stops)
        self.text, self.sent = "", 0

    def push(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string was hit). `final`: the last step."""
        new = self.decoder.push(tokens, final=final)
        self.text += new
        hit = self.stops.feed(new)
        if hit is not None:
            out, self.sent = self.text[self.sent:hit], hit
            return out, True
        safe = len(self.text) if final else len(self.text) - self.stops.held
        out, self.sent = self.text[self.sent:safe], max(self.sent, safe)
        return out, False

    @property
    def sent_text(self) -> str:
        """All the text sent so far: the whole output once the last step is pushed."""
        return self.text[:self.sent]


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper prefix of s[:i+1] that is
    also its suffix. O(len(s))."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
