"""Stop strings on streamed text: `StopStrings` against the obvious quadratic oracle, and its cost.

The oracle is what `Engine.stream` did before: search the unsent text for every stop string,
and hold back the longest tail that is a proper prefix of one, trying every prefix length.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.stopping import StopStrings

ALPHABET = "ab"  # two letters: overlapping, self-similar stop strings are the common case


def oracle(chunks: list[str], stops: tuple[str, ...]) -> list[tuple[int | None, int]]:
    """(hit, held) after each chunk, recomputed from the whole text each time."""
    text, sent, out = "", 0, []
    for chunk in chunks:
        text += chunk
        hits = [i for s in stops if (i := text.find(s, sent)) >= 0]
        held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
                   default=0)
        if hits:  # generation ends here: nothing is held back any more
            out.append((min(hits), None))
            break
        out.append((None, held))
        sent = len(text) - held
    return out


@settings(max_examples=400, deadline=None, derandomize=True)
@given(chunks=st.lists(st.text(ALPHABET, max_size=6), max_size=12),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4))
def test_stop_strings_match_the_oracle(chunks, stops):
    stops = tuple(stops)
    matcher, got = StopStrings(stops), []
    for chunk in chunks:
        hit = matcher.feed(chunk)
        got.append((hit, matcher.held if hit is None else None))
        if hit is not None:
            break
    assert got == oracle(chunks, stops)


class CountingStr(str):
    """A stop string that counts how often it is read (indexing or slicing), and fails at once
    past `budget` reads rather than let a quadratic matcher run for minutes."""

    reads, budget = 0, None

    def __getitem__(self, key):
        CountingStr.reads += 1
        if CountingStr.budget is not None and CountingStr.reads > CountingStr.budget:
            raise AssertionError(f"the stop string was read over {CountingStr.budget} times")
        return super().__getitem__(key)


def linear_budget(stop_length: int, text_length: int) -> int:
    """Reads a linear matcher may make: the failure function reads each stop character a few
    times, matching reads at most two per text character (one forward, amortized fall-backs)."""
    return 5 * (stop_length + text_length)


def test_work_is_linear_in_text_and_stop_length():
    """A 100k-character stop string of one letter and a text of that letter (the worst case for
    prefix checks: every prefix matches) fed one character at a time: the matcher reads the
    stop string O(stop + text) times, where checking every prefix at each step would read it
    stop x text times (10^9 here)."""
    length, steps = 100_000, 10_000
    CountingStr.reads, CountingStr.budget = 0, linear_budget(length, steps)
    matcher = StopStrings((CountingStr("a" * length),))
    for _ in range(steps):
        assert matcher.feed("a") is None
    assert matcher.held == steps
