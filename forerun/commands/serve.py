"""The `forerun serve` command: its flags, loading the engine once, and running uvicorn.

Owns: the server's options (their defaults are named in `forerun.serve.limits`). The web stack
(FastAPI, uvicorn) is imported only when the command runs, so other commands start without it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rich.console import Console

from forerun.api import DEFAULT_MAX_TOKENS
from forerun.commands.options import add_model_args, add_spec_args, load_engine
from forerun.serve.limits import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_QUEUE,
    DEFAULT_SLOTS,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
)

API_KEY_ENV = "FORERUN_API_KEY"
SHUTDOWN_GRACE_S = 10  # on Ctrl-C / SIGTERM, open streams get this long to finish
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(sub) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve /v1/completions and /v1/chat/completions (streaming or not), "
        "/v1/models, /metrics (Prometheus) and /health. Requests choose their speculation with "
        "the extension field \"speculation\"; the flags below set the default. On a GPU the "
        "decode passes of every slot are recorded (CUDA graphs) before the first request.")
    s.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="port")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/ (or set {API_KEY_ENV}); "
                        "unset = no key")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send; unset = the --target name")
    g = s.add_argument_group("limits")
    g.add_argument("--max-concurrent", type=int, default=DEFAULT_SLOTS,
                   help="requests decoded at once, in turn, one KV cache each")
    g.add_argument("--max-queue", type=int, default=DEFAULT_QUEUE,
                   help="requests waiting for a slot; beyond that the answer is 429")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="new tokens for a request that gives no max_tokens")
    g.add_argument("--max-tokens-limit", type=int, default=MAX_TOKENS_LIMIT,
                   help="the largest max_tokens a request may ask for")
    g.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body; larger ones get 413")
    g = s.add_argument_group("speculation under load")
    g.add_argument("--spec-reduce-above", type=int, default=None, metavar="N",
                   help="with more than N requests in flight (running + queued), draft at most "
                        "half of k; unset = never")
    g.add_argument("--spec-off-above", type=int, default=None, metavar="N",
                   help="with more than N requests in flight, no drafting: plain decoding steps; "
                        "unset = never")
    add_model_args(s)
    add_spec_args(s)
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning",
                                                            "info", "debug"])
    s.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from forerun.serve.app import ServeConfig, create_app
    from forerun.serve.worker import LoadShedding, Worker

    for flag, value, least in (("--max-concurrent", args.max_concurrent, 1),
                               ("--max-queue", args.max_queue, 0),
                               ("--max-tokens", args.max_tokens, 1),
                               ("--max-tokens-limit", args.max_tokens_limit, 1),
                               ("--max-body-bytes", args.max_body_bytes, 1),
                               ("--spec-reduce-above", args.spec_reduce_above, 0),
                               ("--spec-off-above", args.spec_off_above, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    err = Console(stderr=True)
    engine = load_engine(args, err)
    with err.status("starting the worker"):
        worker = Worker(engine, slots=args.max_concurrent, max_queue=args.max_queue,
                        shedding=LoadShedding(args.spec_reduce_above, args.spec_off_above))
    with err.status("recording the decode passes (CUDA graphs)"):
        started = time.perf_counter()
        recorded = worker.warm_up()
    if recorded:
        err.print(f"recorded {recorded} decode pass sizes in {time.perf_counter() - started:.1f} s",
                  highlight=False)
    name = args.served_model_name or (Path(args.target).name if Path(args.target).exists()
                                      else args.target)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    config = ServeConfig(name, api_key, args.max_body_bytes, args.max_tokens_limit,
                         args.max_tokens)
    if args.host not in LOOPBACK and not api_key:
        err.print(f"[yellow]warning:[/] serving on {args.host} without --api-key: anyone who "
                  "can reach this port can use the model")
    err.print(f"serving {name!r} ({args.method}, k={args.k}, {args.max_concurrent} slots) on "
              f"http://{args.host}:{args.port}/v1", highlight=False)
    uvicorn.run(create_app(worker, config), host=args.host, port=args.port,
                log_level=args.log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    return 0
