"""One HTTP request run through an ASGI app in this process, its response as records.

Owns: `Forwarded` (a request as the ingress hands it to a replica: method, path, headers, body),
`Start` (the response's status and headers) and `call_app`, which runs forerun's own serve app
(`forerun.serve.app.create_app`) on a `Forwarded` request and yields the `Start`, then the body
chunks as the app sends them (a stream's events one by one). Closing the iterator early (the
client went away, the ingress cancelled) tells the app the client disconnected and cancels it,
so that its jobs leave the batch. Knows nothing of Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

Headers = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Forwarded:
    method: str
    path: str
    query: bytes
    headers: Headers  # lower-case names, as ASGI has them
    body: bytes


@dataclass(frozen=True)
class Start:
    status: int
    headers: Headers


def scope_of(request: Forwarded) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": "http",
            "path": request.path, "raw_path": request.path.encode(), "root_path": "",
            "query_string": request.query, "headers": list(request.headers),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}


async def call_app(app: ASGIApp, request: Forwarded, extra_headers: Headers = ()
                   ) -> AsyncIterator[Start | bytes]:
    """`Start` (with `extra_headers` added), then the body's chunks, as `app` sends them."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()  # a stream's disconnect listener waits here until the end
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    task = asyncio.create_task(app(scope_of(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield Start(message["status"], (*message.get("headers", ()), *extra_headers))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        gone.set()
        await task  # the app ends by itself once it has sent its last chunk; or it raised
    finally:
        gone.set()
        if not task.done():
            task.cancel()
