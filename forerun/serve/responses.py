"""A request's worker events turned into its OpenAI response: whole, or as server-sent events.

Owns: `collect` (a non-streaming body), `stream_events` (the SSE chunks: text deltas, finish
chunks, usage, [DONE]), and the completions' `echo`: the prompt sent back before the text, with
its tokens' logprobs (from the prefill's rows; the first token has none) where logprobs are
asked. Tool calls are read out of the text here (`forerun.serve.tools`). Knows the event types
of `forerun.serve.worker` and the bodies of `forerun.serve.protocol`; never touches a model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from forerun.metrics import TokenLogprob
from forerun.serve.limits import DISCONNECT_POLL_S
from forerun.serve.protocol import APIError, Shape, error_body, usage
from forerun.serve.tools import ToolText, parse_calls
from forerun.serve.worker import Delta, Done, Event, Failed


@dataclass(frozen=True)
class Echo:
    """A completion's prompt as it is sent back before the text (`echo`): its text, and its
    tokens for their logprobs."""

    text: str
    ids: list[int]


async def collect(request: Request, queue: asyncio.Queue[Event], shape: Shape, n: int,
                  prompt_tokens: int, asked: bool = False, tools: bool = False,
                  echo: Echo | None = None) -> Response:
    """A whole (non-streaming) response (with logprobs where `asked`, the prompt before the
    text under `echo`); gives up when the client goes away."""
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    echoed: list[dict | None] = [None] * n  # each choice's prompt logprobs columns
    done: dict[int, Done] = {}
    clock = asyncio.get_running_loop().time
    next_check = clock() + DISCONNECT_POLL_S
    while len(done) < n:
        try:
            event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            event = None
        if clock() >= next_check:  # events may keep coming: check by the clock
            if await request.is_disconnected():
                return Response(status_code=499)  # nobody reads it; the jobs are cancelled
            next_check = clock() + DISCONNECT_POLL_S
        if event is None:
            continue
        if isinstance(event, Failed):
            raise APIError(500, event.message)
        if isinstance(event, Delta):
            if echo is not None and asked and event.step.prefill:
                echoed[event.index] = shape.prompt_logprobs(echo.ids, event.step.prompt_logprobs)
            texts[event.index].append(event.text)
            logprobs[event.index].extend(event.step.logprobs or ())
        else:
            done[event.index] = event
    choices = []
    for i in range(n):
        text, calls = "".join(texts[i]), []
        if tools:
            text, calls = parse_calls(text)
        choices.append(shape.choice(i, text, "tool_calls" if calls else done[i].finish_reason,
                                    done[i].stats.to_dict(), logprobs[i] if asked else None,
                                    calls, prefix=echo.text if echo else "",
                                    prefix_logprobs=echoed[i]))
    completion_tokens = sum(d.completion_tokens for d in done.values())
    return JSONResponse(shape.response(choices, usage(prompt_tokens, completion_tokens)))


async def stream_events(queue: asyncio.Queue[Event], shape: Shape, n: int, prompt_tokens: int,
                        include_usage: bool, stream_stats: bool, logprobs: bool = False,
                        tools: bool = False, echo: Echo | None = None) -> AsyncIterator[str]:
    """Server-sent events: text deltas (with their tokens' logprobs when asked; under `echo`
    the prompt first, as each choice's first text), one finishing chunk per choice (with its
    speculation stats), the usage chunk when asked, then [DONE]."""
    if shape.chat:
        for i in range(n):
            yield sse(shape.chunk(i, "", role=True))
    done: dict[int, Done] = {}
    chars = [0] * n  # text sent so far per choice (the completions' text_offset)
    split = [ToolText() for _ in range(n)] if tools else None  # content vs tool calls
    while len(done) < n:
        event = await queue.get()
        if isinstance(event, Failed):
            yield sse(error_body(event.message, "server_error"))
            break
        if isinstance(event, Delta):
            if echo is not None and event.step.prefill:
                yield sse(shape.chunk(event.index, echo.text, logprobs=shape.prompt_logprobs(
                    echo.ids, event.step.prompt_logprobs) if logprobs else None))
                chars[event.index] += len(echo.text)
            lps = shape.logprobs(event.step.logprobs, chars[event.index]) if logprobs else None
            text, calls = event.text, []
            if split is not None:
                text, calls = split[event.index].push(text)
            if text or calls or stream_stats or (lps is not None and event.step.tokens):
                yield sse(shape.chunk(event.index, text,
                                      speculation=event.stats if stream_stats else None,
                                      logprobs=lps, tool_calls=_indexed(calls, split, event)))
            chars[event.index] += len(event.text)
            continue
        done[event.index] = event
        reason = event.finish_reason
        if split is not None:
            if rest := split[event.index].finish():
                yield sse(shape.chunk(event.index, rest))
            reason = "tool_calls" if split[event.index].calls else reason
        yield sse(shape.chunk(event.index, None, reason, event.stats.to_dict()))
    else:
        if include_usage:
            completion_tokens = sum(d.completion_tokens for d in done.values())
            yield sse(shape.usage_chunk(usage(prompt_tokens, completion_tokens)))
    yield "data: [DONE]\n\n"


def _indexed(calls: list[dict], split: list[ToolText] | None, event: Delta) -> list[dict]:
    """Stream deltas of completed calls, each with its index among the choice's calls."""
    if not calls or split is None:
        return []
    first = len(split[event.index].calls) - len(calls)
    return [{"index": first + j, **call} for j, call in enumerate(calls)]


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
