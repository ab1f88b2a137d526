"""The HTTP side of `forerun serve`: FastAPI routes that validate, enqueue and stream.

Owns: the routes (`/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/metrics`,
`/health`), the request gate (Host allow-list, API key, body size, request counting), turning a
request into worker jobs (the bodies they become: `forerun.serve.responses`), and turning
every refusal into a 4xx with an OpenAI-style body.
An unexpected exception reaches a client as a short message; its traceback goes to the log.
Never touches a model: tokenizing is the only model-related work done here (the tokenizer is
thread-safe); generation happens on the worker thread (`forerun.serve.worker`).

Each request gets an asyncio queue; the worker thread puts its events there with
`call_soon_threadsafe`. When the response ends for any reason (finished, client gone, error),
its unfinished jobs are cancelled, which frees their slots.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forerun.api import DEFAULT_MAX_TOKENS
from forerun.heads import KINDS as HEAD_KINDS
from forerun.models.catalog import ModelError
from forerun.policy import POLICIES
from forerun.propose import PROPOSERS, SpecConfig
from forerun.serve.limits import MAX_BODY_BYTES, MAX_TOKENS_LIMIT
from forerun.serve.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    Shape,
    Speculation,
    chat_messages,
    logprobs_wanted,
    stop_strings,
    unsupported,
)
from forerun.serve.request_sampling import request_sampling
from forerun.serve.responses import Echo, collect, stream_events
from forerun.serve.tools import check_tools
from forerun.serve.worker import (
    Busy,
    Event,
    Job,
    Stopped,
    Worker,
    short_error,
)

log = logging.getLogger("forerun.serve")
PATHS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ServeConfig:
    model_name: str  # the id clients send as `model`
    api_key: str | None = None  # required as `Authorization: Bearer KEY` on /v1/ when set
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request gives no max_tokens
    # the Host header values accepted (lower case, with the port as clients send it); None =
    # any. A server on loopback without a key is reachable from a browser's page through DNS
    # rebinding (evil.example resolving to 127.0.0.1) unless it refuses foreign Host values.
    allowed_hosts: frozenset[str] | None = None
    metrics_auth: bool = False  # /metrics needs the API key too (when one is set)


def create_app(worker: Worker, config: ServeConfig) -> FastAPI:
    """The app over a (not yet started) worker; the app starts and stops it."""
    engine = worker.engine
    capacity, vocab = engine.target.capacity, engine.target.config.vocab_size

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not worker.alive:
            worker.start()
        yield
        await run_in_threadpool(worker.stop)

    app = FastAPI(title="forerun", summary="OpenAI-compatible speculative decoding server",
                  lifespan=lifespan)
    app.state.max_body_bytes = config.max_body_bytes
    app.add_middleware(Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       count=lambda path, status: worker.metrics.requests.labels(
                           path, status).inc(),
                       allowed_hosts=config.allowed_hosts, metrics_auth=config.metrics_auth)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> JSONResponse:
        running, waiting = worker.in_flight
        ok = worker.alive
        return JSONResponse({"status": "ok" if ok else "worker stopped", "running": running,
                             "waiting": waiting, "speculation_mode": worker.mode,
                             "worker_restarts": worker.restarts},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(worker.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{
            "id": config.model_name, "object": "model", "created": 0, "owned_by": "forerun",
            "max_model_len": capacity}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request(body)
        ids = await run_in_threadpool(prompt_ids, body.prompt)
        return await generate(request, body, ids, Shape(chat=False, model=config.model_name,
                                                                   token_text=token_text),
                              echo=echoed(body.prompt, ids) if body.echo else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        check_request(body)
        ids = await run_in_threadpool(chat_ids, body)
        return await generate(request, body, ids, Shape(chat=True, model=config.model_name,
                                                                  token_text=token_text))

    def check_request(body: CompletionRequest | ChatRequest) -> None:
        if body.model != config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{config.model_name!r}", param="model", code="model_not_found")
        unsupported(body)

    def prompt_ids(prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (send several requests, or use n)",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return engine.tokenizer.encode_prompt(prompt, raw=True)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)

    def token_text(token: int) -> str:
        return engine.tokenizer.token_text(token)

    def echoed(prompt, ids: list[int]) -> Echo:
        """The prompt as `echo` sends it back: as given where it is text, else decoded."""
        text = prompt if isinstance(prompt, str) else prompt[0] if prompt and isinstance(
            prompt[0], str) else engine.tokenizer.decode(ids)
        return Echo(text, ids)

    def chat_ids(body: ChatRequest) -> list[int]:
        tools = None if body.tool_choice == "none" else check_tools(body.tools)
        if tools and not engine.tokenizer.renders_tools():
            raise APIError(400, "this model's chat template does not render tools",
                           param="tools")
        try:
            return engine.tokenizer.encode_chat(chat_messages(body.messages), tools)
        except (ModelError, jinja2.TemplateError) as e:
            raise APIError(400, str(e), param="messages") from e

    def budget(body: CompletionRequest | ChatRequest, ids: list[int]) -> int:
        """max_tokens, checked against the limit and the context."""
        param = "prompt" if isinstance(body, CompletionRequest) else "messages"
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        room = capacity - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context holds "
                           f"{capacity}", param=param, code="context_length_exceeded")
        chat = body.max_completion_tokens if isinstance(body, ChatRequest) else None
        asked = chat or body.max_tokens
        if asked is None:
            return min(config.default_max_tokens, room)
        if asked > config.max_tokens_limit:
            raise APIError(400, f"max_tokens is {asked}; this server allows at most "
                           f"{config.max_tokens_limit}", param="max_tokens")
        if asked > room:
            raise APIError(400, f"this model's context holds {capacity} tokens; the prompt has "
                           f"{len(ids)} and max_tokens asks for {asked} more", param="max_tokens",
                           code="context_length_exceeded")
        return asked

    async def generate(request: Request, body: CompletionRequest | ChatRequest, ids: list[int],
                       shape: Shape, echo: Echo | None = None) -> Response:
        max_tokens = budget(body, ids)
        sampling = request_sampling(body, engine.tokenizer, vocab)
        spec, stream_stats = resolve_spec(body.speculation, engine.spec,
                                          has_draft=engine.draft is not None,
                                          heads=engine.heads.cfg.kind if engine.heads else None)
        stop, n, logprobs = stop_strings(body.stop), body.n or 1, logprobs_wanted(body)
        tools = (isinstance(body, ChatRequest) and bool(body.tools)
                 and body.tool_choice != "none")  # calls are read out of the text
        loop, queue = asyncio.get_running_loop(), asyncio.Queue[Event]()

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        jobs = [Job(ids, replace(sampling, seed=None if body.seed is None else body.seed + i),
                    max_tokens, stop, spec, emit, index=i, logprobs=logprobs,
                    prompt_logprobs=logprobs if echo else None)
                for i in range(n)]
        try:
            worker.submit(jobs)
        except Busy as e:
            raise APIError(429, str(e), code="server_busy", type="rate_limit_error") from e
        except Stopped as e:
            raise APIError(503, str(e), code="server_stopping") from e

        def cancel() -> None:
            for job in jobs:
                worker.cancel(job)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(queue, shape, n, len(ids), include_usage, stream_stats,
                                   logprobs is not None, tools, echo)
            return EventStream(events, on_close=cancel)
        try:
            return await collect(request, queue, shape, n, len(ids), logprobs is not None, tools,
                                 echo)
        finally:
            cancel()  # finished jobs ignore it; a client gone or an error frees the slots

    return app


def resolve_spec(field: Speculation | None, default: SpecConfig, *, has_draft: bool,
                 heads: str | None = None) -> tuple[SpecConfig, bool]:
    """The request's speculation (the server's where it says nothing) and whether it wants
    running stats in every stream chunk."""
    if field is None:
        return default, False
    method = field.method or default.method
    if method != "none" and method not in PROPOSERS:
        raise APIError(400, f"unknown speculation method {method!r}; choose none, "
                       f"{', '.join(PROPOSERS)}", param="speculation.method")
    if SpecConfig(method, multi_methods=default.multi_methods).uses_draft and not has_draft:
        raise APIError(400, "this server has no draft model loaded (start it with --method "
                       "draft); use method ngram or none", param="speculation.method")
    if method in HEAD_KINDS and method != heads:
        raise APIError(400, f"this server has no {method} heads loaded (start it with --heads "
                       f"and --method {method}){'; it has ' + heads if heads else ''}",
                       param="speculation.method")
    policy = field.policy or default.policy
    if policy not in POLICIES:
        raise APIError(400, f"unknown policy {policy!r}; choose {', '.join(POLICIES)}",
                       param="speculation.policy")
    ngram_min = field.ngram_min or default.ngram_min
    ngram_max = field.ngram_max or default.ngram_max
    if ngram_min > ngram_max:
        raise APIError(400, f"need ngram_min ({ngram_min}) <= ngram_max ({ngram_max})",
                       param="speculation.ngram_min")
    k = default.k if field.k is None else field.k
    if field.shadow and method == "none":
        raise APIError(400, "shadow speculation needs a drafting method",
                       param="speculation.shadow")
    shadow = default.shadow if field.shadow is None else field.shadow
    # every method's own options (suffix, multi, lookahead, layer-skip, magicdec, qspec,
    # early-exit, the tree) stay the server's
    return replace(default, method=method, k=k, policy=policy, ngram_min=ngram_min,
                   ngram_max=ngram_max, lookup=default.lookup and method in HEAD_KINDS,
                   shadow=shadow and method != "none"), field.stream_stats


class EventStream(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends: finished, client
    disconnected (Starlette cancels the stream) or failed."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# --- the gate and the error bodies ---------------------------------------------------------------

class Gate:
    """Pure ASGI middleware in front of every route: checks the Host header against the
    allow-list (421 otherwise), the API key on /v1/ paths (and /metrics with `metrics_auth`) and
    the body size (Content-Length at once, a chunked body as it arrives), and counts every
    answered request by path (unknown paths as "other", so fuzzing cannot grow the label set)
    and status.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 count: Callable[[str, str], None], allowed_hosts: frozenset[str] | None = None,
                 metrics_auth: bool = False):
        self.app, self.api_key, self.max_body_bytes, self.count = (
            app, api_key, max_body_bytes, count)
        self.allowed_hosts, self.metrics_auth = allowed_hosts, metrics_auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                await api_error_response(refusal)(scope, receive, counted)
            else:
                await self.app(scope, self.limited(receive), counted)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            self.count(path, str(status))

    def refusal(self, scope: Scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        host = headers.get("host", "").lower()
        if self.allowed_hosts is not None and host not in self.allowed_hosts:
            return APIError(421, f"this server does not answer for the host {host[:100]!r} "
                            "(start it with --allowed-host to add one)", code="host_not_allowed")
        path = scope["path"]
        keyed = path.startswith("/v1/") or (self.metrics_auth and path == "/metrics")
        if self.api_key is not None and keyed:
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                code="invalid_api_key")
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            return body_too_large(self.max_body_bytes)
        return None

    def limited(self, receive: Receive) -> Receive:
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise HTTPException(413)  # answered by the handler below, as an APIError
            return message

        return receive_limited


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit} bytes",
                    code="request_too_large")


def api_error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


HTTP_MESSAGES = {404: "no such route", 405: "method not allowed on this route",
                 400: "the request body is not valid JSON"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return api_error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            error = APIError(400, f"the request body is not valid JSON: "
                             f"{first.get('ctx', {}).get('error', '')}", code="invalid_json")
        else:
            param = ".".join(loc) or None
            more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
            error = APIError(400, f"{param or 'body'}: {first.get('msg')}{more}", param=param)
        return api_error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 413:
            return api_error_response(body_too_large(request.app.state.max_body_bytes))
        message = HTTP_MESSAGES.get(e.status_code, str(e.detail))
        return api_error_response(APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return api_error_response(APIError(500, f"internal error ({short_error(e)})"))
