"""When generation stops: stop tokens, the token budget, and the context window.

Owns: the checks both decoders share so that plain and speculative decoding stop at exactly the
same token. A stop token ends generation and is not emitted (as in the OpenAI API).
"""

from __future__ import annotations

from collections.abc import Collection


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
