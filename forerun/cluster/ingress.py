"""The cluster's front door: a Ray Serve ingress that forwards each request to an engine replica.

Owns: the routes clients see (`/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`,
`/metrics`), the same gate as one server's (`forerun.serve.app.Gate`: Host allow-list, API key,
body size, request counting), the prefix key a request is routed by, and what a client gets
when its replica dies.

A request's body is read here (the router needs its prompt) and sent whole to a replica, which
runs forerun's own serve app on it and streams the response back part by part (SSE events as
they come). Validation, tokenizing and generation all happen in the replica.

Replica failures. When the replica dies (killed, its node lost) before its response has begun,
the request is sent again, to a live replica (at most MAX_ATTEMPTS sends): nothing was
generated for the client yet, so nothing is duplicated. When the response had begun, the
client gets what was sent, then an error (a streaming response: an SSE error event, the shape
forerun's server uses for a failed request), and the request is counted. Either way only that
replica's requests are touched; Ray Serve's controller replaces the replica, and its router
sends new requests to the live ones meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.types import Receive, Scope, Send

from forerun.cluster.asgi import Forwarded, Start
from forerun.cluster.routing import prefix_key
from forerun.cluster.spec import APP_NAME
from forerun.serve.app import Gate, ServeConfig, install_error_handlers
from forerun.serve.protocol import APIError, error_body
from forerun.serve.responses import sse

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger("forerun.cluster")
MAX_ATTEMPTS = 3  # sends of one request to replicas that die before answering
STATUS_TTL_S = 1.0  # /health reads the replicas' states from the controller at most this often
ENGINE_DEPLOYMENT = "EngineReplica"
REPLICA_DIED = "replica_died"


def replica_died(detail: str) -> str:
    return (f"the replica serving this request died ({detail}); the other replicas go on and "
            "a new one is starting: retry")


class Ingress:
    """The ingress deployment's state: the engine replicas' handle and the counters."""

    def __init__(self, engines: DeploymentHandle, config: ServeConfig, prefix_routing: bool):
        from ray.exceptions import ActorUnavailableError, RayActorError

        self.engines = engines  # EngineReplica's
        self.config, self.prefix_routing = config, prefix_routing
        self.lost = (RayActorError, ActorUnavailableError)  # what a dead replica raises
        r = self.registry = CollectorRegistry()
        self.requests = Counter("forerun_cluster_requests", "HTTP requests answered by the "
                                "ingress, by path and status", ["path", "status"], registry=r)
        self.replica_failures = Counter("forerun_cluster_replica_failures", "requests whose "
                                        "replica died, by outcome: resent (before any output) "
                                        "or failed (mid-response)", ["outcome"], registry=r)
        self._status: tuple[float, dict[str, int]] = (0.0, {})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self)

    def replica_states(self) -> dict[str, int]:
        """{state: replicas} of the engine deployment, as Ray Serve's controller sees it."""
        from ray import serve

        at, states = self._status
        if time.monotonic() - at > STATUS_TTL_S:
            app = serve.status().applications.get(APP_NAME)
            deployment = app.deployments.get(ENGINE_DEPLOYMENT) if app else None
            states = dict(deployment.replica_states) if deployment else {}
            self._status = (time.monotonic(), states)
        return states

    async def send(self, request: Request) -> Response:
        body = await request.body()
        forwarded = Forwarded(request.method, request.url.path,
                              request.url.query.encode(), tuple(request.scope["headers"]), body)
        key = prefix_key(forwarded.path, body) if self.prefix_routing else None
        detail = "no replica answered"
        for _ in range(MAX_ATTEMPTS):
            parts = self.engines.options(stream=True).serve_http.remote(forwarded,
                                                                        prefix_key=key)
            try:
                start = await anext(parts)
            except self.lost as e:
                detail = type(e).__name__
                self.replica_failures.labels("resent").inc()
                log.warning("a replica died before answering (%s); sending again", detail)
                continue
            return Relay(start, parts, self)
        raise APIError(503, replica_died(detail), code=REPLICA_DIED)


class Relay(Response):
    """A replica's response as it streams in; a replica lost mid-way ends it with an error."""

    def __init__(self, start: Start, parts: AsyncIterator[bytes], ingress: Ingress):
        super().__init__()
        self.start, self.parts, self.ingress = start, parts, ingress

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.start.status,
                    "headers": list(self.start.headers)})
        stream = (b"content-type", b"text/event-stream") in [
            (k.lower(), v.split(b";")[0]) for k, v in self.start.headers]
        try:
            async for part in self.parts:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        except self.ingress.lost as e:
            self.ingress.replica_failures.labels("failed").inc()
            log.warning("a replica died mid-response (%s)", type(e).__name__)
            if stream:
                error = error_body(replica_died(type(e).__name__), "server_error",
                                   code=REPLICA_DIED)
                await send({"type": "http.response.body", "body": sse(error).encode(),
                            "more_body": True})
        finally:
            self.parts.cancel()  # a client gone: the replica drops the request's jobs
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(ingress: Ingress) -> FastAPI:
    config = ingress.config
    app = FastAPI(title="forerun cluster", summary="OpenAI-compatible speculative decoding "
                  "over Ray Serve replicas")
    app.state.max_body_bytes = config.max_body_bytes
    app.add_middleware(Gate, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       count=lambda path, status: ingress.requests.labels(path, status).inc(),
                       allowed_hosts=config.allowed_hosts, metrics_auth=config.metrics_auth)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> JSONResponse:
        states = ingress.replica_states()
        running = states.get("RUNNING", 0)
        return JSONResponse({"status": "ok" if running else "no replica running",
                             "replicas": states}, status_code=200 if running else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(ingress.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await ingress.send(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await ingress.send(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await ingress.send(request)

    return app
