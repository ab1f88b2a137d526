"""The `forerun serve` command: its flags, loading the engine once, and running uvicorn.

Owns: the server's options (their defaults are named in `forerun.serve.limits`), the Host
allow-list it derives from the address, and the start-up: load, record CUDA graphs, calibrate
the forward-time curves (unless --no-calibrate), serve. The web stack (FastAPI, uvicorn) is
imported only when the command runs, so other commands start without it. Exits 1 when the worker
gives up (repeated crashes), so that a supervisor restarts the process. With --ray the same
server runs as replicas of a Ray Serve application (`forerun.cluster`, docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from rich.console import Console

from forerun.api import DEFAULT_KV_BUDGET_BYTES, DEFAULT_MAX_TOKENS
from forerun.commands.options import (
    add_model_args,
    add_ray_strategy_arg,
    add_spec_args,
    load_config,
    load_engine,
    spec_config,
)
from forerun.serve.limits import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_HOST,
    DEFAULT_KV_FRACTION,
    DEFAULT_PORT,
    DEFAULT_QUEUE,
    DEFAULT_SLOTS,
    MAX_BODY_BYTES,
    MAX_RESTARTS,
    MAX_TOKENS_LIMIT,
    SPEC_POLICIES,
)
from forerun.train.online import OnlineConfig

API_KEY_ENV = "FORERUN_API_KEY"
SHUTDOWN_GRACE_S = 10  # on Ctrl-C / SIGTERM, open streams get this long to finish
LOOPBACK = ("127.0.0.1", "localhost", "::1")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # as they appear in a Host header
DEFAULT_HTTP_PORT = 80  # a Host header may leave it out


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
                        "unset = no key. Visible in `ps`: prefer --api-key-file")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line)")
    s.add_argument("--metrics-auth", action="store_true",
                   help="/metrics needs the API key too")
    s.add_argument("--allowed-host", action="append", default=[], metavar="HOST[:PORT]",
                   help="a Host header value to accept, exactly as clients send it, besides "
                        "localhost/127.0.0.1/[::1] at --port (repeatable); others get 421. On a "
                        "non-loopback address without it, any Host is accepted")
    s.add_argument("--no-calibrate", action="store_true",
                   help="skip measuring the forward-time curves at start-up; a request with "
                        "policy cost (or a server with --tree auto) then measures them in its "
                        "first step, while the other slots wait")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send; unset = the --target name")
    g = s.add_argument_group("limits")
    g.add_argument("--max-concurrent", type=int, default=DEFAULT_SLOTS,
                   help="requests decoded at once: the most members of one batch")
    g.add_argument("--max-queue", type=int, default=DEFAULT_QUEUE,
                   help="requests waiting to join the batch; beyond that the answer is 429")
    g.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="KV cache memory per model (target, draft); a request reserves its "
                        "prompt + max_tokens and waits while it does not fit. Unset = "
                        f"{DEFAULT_KV_BUDGET_BYTES / 2**30:g} GB, or "
                        f"{DEFAULT_KV_FRACTION * 100:.0f}%% of the memory available at start-up if "
                        "that is less")
    g.add_argument("--kv-reserve", choices=["grow", "worst"], default="grow",
                   help="grow: a request reserves its prompt and a little more and grows as "
                        "it decodes; when memory runs out the youngest is preempted and "
                        "recomputed later (its output unchanged). worst: each reserves its "
                        "prompt + max_tokens up front, never preempted")
    g.add_argument("--prefix-cache-gb", type=float, default=None, metavar="GB",
                   help="KV of prompt blocks kept for later prompts that begin the same way (a "
                        "system prompt, a chat history sent again): they skip that part of "
                        "the prefill. Unset = a quarter of the KV cache; 0 = off")
    g.add_argument("--max-batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                   help="rows of one target pass: decodes first, prompts in chunks with what "
                        "is left (at least a quarter of it), so a long prompt never stalls the "
                        "decodes around it")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="new tokens for a request that gives no max_tokens")
    g.add_argument("--max-tokens-limit", type=int, default=MAX_TOKENS_LIMIT,
                   help="the largest max_tokens a request may ask for")
    g.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="largest request body; larger ones get 413")
    g = s.add_argument_group("speculation under load")
    g.add_argument("--spec-policy", choices=SPEC_POLICIES, default="adaptive",
                   help="adaptive: at every pass the batch's cost policy chooses each request's "
                        "draft length from the measured cost of a pass of that many rows (its k "
                        "as the cap), so drafting shrinks as the batch fills; always: each "
                        "request drafts by its own --policy; off: plain decoding")
    g.add_argument("--spec-reduce-above", type=int, default=None, metavar="N",
                   help="with more than N requests in flight (running + queued), draft at most "
                        "half of k; unset = never")
    g.add_argument("--spec-off-above", type=int, default=None, metavar="N",
                   help="with more than N requests in flight, no drafting: plain decoding steps; "
                        "unset = never")
    g = s.add_argument_group("online distillation (a Medusa head learning from the traffic)")
    g.add_argument("--online-distill", action="store_true",
                   help="with --method medusa: the verify passes hand the positions the head "
                        "got wrong to a background trainer, whose updated head is swapped in "
                        "between passes (the output never changes; acceptance does: "
                        "/metrics). Without --heads a new head learns from zero. The head "
                        "drafts in float32")
    g.add_argument("--online-distill-dir", default=None, metavar="DIR",
                   help="checkpoints of the trained head (a --heads directory); a restart "
                        "with the same DIR starts from the last one")
    g.add_argument("--online-distill-every", type=int, default=OnlineConfig.every, metavar="N",
                   help="an update of the head every N new wrong positions")
    g.add_argument("--online-distill-steps", type=int, default=OnlineConfig.steps,
                   help="AdamW steps an update")
    g.add_argument("--online-distill-lr", type=float, default=OnlineConfig.lr)
    g.add_argument("--online-distill-buffer", type=int, default=OnlineConfig.buffer,
                   metavar="N", help="positions the trainer keeps (the oldest go first)")
    g.add_argument("--online-distill-threads", type=int, default=OnlineConfig.threads,
                   help="the trainer's compute threads")
    g.add_argument("--online-distill-share", type=float, default=OnlineConfig.share,
                   metavar="F", help="the most of its time the trainer computes (it sleeps "
                        "the rest): bounds what it takes from serving")
    g.add_argument("--online-distill-heads", type=int, default=4, metavar="N",
                   help="a new head's number of Medusa heads (tokens a draft holds)")
    g.add_argument("--online-distill-vocab", type=int, default=16384, metavar="N",
                   help="a new head's reduced vocabulary (most frequent ids; 0 = all)")
    g = s.add_argument_group("scale-out on Ray (pip install 'forerun[cluster]'; docs/cluster.md)")
    g.add_argument("--ray", action="store_true",
                   help="serve --replicas engine replicas as a Ray Serve application behind "
                        "one endpoint at --host:--port; each replica is this server, with these "
                        "limits. A request goes to the least loaded replica, or (prefix cache "
                        "on) to the one holding its prompt's first block")
    g.add_argument("--replicas", type=int, default=2, help="engine replicas (--ray)")
    g.add_argument("--replica-cores", type=int, default=1,
                   help="CPUs each replica reserves and runs its threads on (--ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="an existing Ray cluster (auto, HOST:6379); unset = a local one on "
                        "this machine of replicas x cores CPUs, stopped on exit")
    g.add_argument("--ray-detach", action="store_true",
                   help="with --ray-address: deploy (or rescale: another --replicas) and exit; "
                        "the application keeps serving until `serve shutdown`")
    add_ray_strategy_arg(g)  # --disaggregate: each replica's target and drafter bundles
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
                               ("--max-batch-tokens", args.max_batch_tokens, 1),
                               ("--spec-reduce-above", args.spec_reduce_above, 0),
                               ("--spec-off-above", args.spec_off_above, 0)):
        if value is not None and value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.kv_cache_gb is not None and args.kv_cache_gb <= 0:
        raise ValueError(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    if args.prefix_cache_gb is not None and args.prefix_cache_gb < 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    err = Console(stderr=True)
    api_key = read_api_key(args)
    kv_bytes = (int(args.kv_cache_gb * 2**30) if args.kv_cache_gb is not None
                else default_kv_bytes())
    prefix_bytes = (kv_bytes // 4 if args.prefix_cache_gb is None
                    else int(args.prefix_cache_gb * 2**30))
    online = online_config(args)
    if args.ray:
        return run_on_ray(args, api_key, kv_bytes, prefix_bytes, err)
    engine = load_engine(args, err)
    distiller = None
    if online is not None:
        from forerun.models.load import open_model, target_io
        from forerun.train.online import serving_distiller

        distiller = serving_distiller(
            engine, online, target_io(open_model(args.target), engine.target),
            Path(str(args.target)).name.removesuffix(".gguf"), args.online_distill_heads,
            args.online_distill_vocab)
    with err.status("starting the worker"):
        worker = Worker(engine, slots=args.max_concurrent, max_queue=args.max_queue,
                        kv_cache_bytes=kv_bytes, max_batch_tokens=args.max_batch_tokens,
                        spec_policy=args.spec_policy, prefix_cache_bytes=prefix_bytes,
                        lazy_kv=args.kv_reserve == "grow",
                        shedding=LoadShedding(args.spec_reduce_above, args.spec_off_above),
                        on_fatal=lambda: setattr(server, "should_exit", True),
                        distiller=distiller)
    with err.status("recording the decode passes (CUDA graphs)"):
        started = time.perf_counter()
        recorded = worker.warm_up()
    if recorded:
        err.print(f"recorded {recorded} decode pass sizes in {time.perf_counter() - started:.1f} s",
                  highlight=False)
    if not args.no_calibrate:
        with err.status("measuring forward times (for --policy cost and --tree auto)"):
            started = time.perf_counter()
            worker.calibrate()
        err.print(f"forward times measured in {time.perf_counter() - started:.1f} s (llama.cpp: "
                  "kept on disk, a restart reads them)", highlight=False)
    name = args.served_model_name or (Path(args.target).name if Path(args.target).exists()
                                      else args.target)
    config = ServeConfig(name, api_key, args.max_body_bytes, args.max_tokens_limit,
                         args.max_tokens, allowed_hosts(args.host, args.port, args.allowed_host),
                         args.metrics_auth)
    if args.host not in LOOPBACK and not api_key:
        err.print(f"[yellow]warning:[/] serving on {args.host} without --api-key: anyone who "
                  "can reach this port can use the model")
    err.print(f"serving {name!r} ({args.method}, k={args.k}, spec policy {args.spec_policy}; "
              f"batch of up to {args.max_concurrent}, {kv_bytes / 2**30:.1f} GB of KV cache per "
              f"model) on http://{args.host}:{args.port}/v1", highlight=False)
    server = uvicorn.Server(uvicorn.Config(
        create_app(worker, config), host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run()
    if worker.restarts > MAX_RESTARTS:
        err.print(f"[red]the worker crashed {worker.restarts} times; exiting[/]")
        return 1
    return 0


def run_on_ray(args, api_key: str | None, kv_bytes: int, prefix_bytes: int,
               err: Console) -> int:
    """--ray: deploy replicas of this server on a Ray cluster and serve until stopped."""
    from forerun.cluster.deploy import serve_until_stopped
    from forerun.cluster.spec import (
        REPLICA_DRAFT_CORES,
        ClusterConfig,
        EngineRecipe,
        ReplicaSpec,
        WorkerSettings,
    )
    from forerun.serve.app import ServeConfig
    from forerun.serve.worker import LoadShedding

    if args.online_distill:
        raise ValueError("--online-distill trains one server's head: not with --ray")
    if args.ray_detach and args.ray_address is None:
        raise ValueError("--ray-detach needs --ray-address (a local cluster ends with this "
                         "process)")
    spec = spec_config(args)
    recipe = EngineRecipe(args.target, args.draft if spec.uses_draft else None, spec,
                          load_config(args))
    settings = WorkerSettings(args.max_concurrent, args.max_queue, kv_bytes,
                              args.max_batch_tokens, args.spec_policy, prefix_bytes,
                              args.kv_reserve == "grow",
                              LoadShedding(args.spec_reduce_above, args.spec_off_above),
                              calibrate=not args.no_calibrate)
    name = args.served_model_name or (Path(args.target).name if Path(args.target).exists()
                                      else args.target)
    config = ServeConfig(name, api_key, args.max_body_bytes, args.max_tokens_limit,
                         args.max_tokens, allowed_hosts(args.host, args.port, args.allowed_host),
                         args.metrics_auth)
    if spec.disaggregate and (args.draft_cores or args.target_cores):
        raise ValueError("--ray --disaggregate: each replica takes --replica-cores CPUs and its "
                         "drafter one more; --draft-cores and --target-cores name this "
                         "machine's cores")
    cluster = ClusterConfig(args.replicas, args.replica_cores, args.ray_address, args.host,
                            args.port, prefix_routing=prefix_bytes > 0,
                            draft_cores=REPLICA_DRAFT_CORES if spec.disaggregate else 0,
                            strategy=args.ray_strategy)
    err.print(f"deploying {args.replicas} replicas of {name!r} ({args.method}, "
              f"{args.replica_cores} CPUs each) on {args.ray_address or 'a local Ray cluster'}",
              highlight=False)

    def ready(ray_cluster) -> None:
        err.print(f"serving {name!r} from {args.replicas} replicas on "
                  f"http://{args.host}:{args.port}/v1 (Ray cluster {ray_cluster.address}"
                  f"{'; detached: `serve shutdown` removes it' if args.ray_detach else ''})",
                  highlight=False)

    serve_until_stopped(ReplicaSpec(recipe, settings, config), cluster,
                        detach=args.ray_detach, on_ready=ready)
    return 0


def online_config(args) -> OnlineConfig | None:
    """--online-distill's settings (None without it); its head drafts in float32."""
    if not args.online_distill:
        return None
    if args.method != "medusa":
        raise ValueError(f"--online-distill trains a Medusa head: use --method medusa, not "
                         f"{args.method}")
    if args.head_precision not in ("auto", "float32"):
        raise ValueError("--online-distill drafts with float32 heads; drop --head-precision")
    args.head_precision = "float32"
    return OnlineConfig(args.online_distill_every, args.online_distill_steps,
                        lr=args.online_distill_lr, buffer=args.online_distill_buffer,
                        threads=args.online_distill_threads, share=args.online_distill_share,
                        directory=args.online_distill_dir)


def default_kv_bytes() -> int:
    """DEFAULT_KV_BUDGET_BYTES, or DEFAULT_KV_FRACTION of the memory available now if less."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: no figure to go by
        return DEFAULT_KV_BUDGET_BYTES
    return max(min(DEFAULT_KV_BUDGET_BYTES, int(available * DEFAULT_KV_FRACTION)), 64 << 20)


def read_api_key(args) -> str | None:
    """--api-key-file, else --api-key, else $FORERUN_API_KEY; None = no key."""
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from e
        if not lines or not lines[0].strip():
            raise ValueError(f"--api-key-file: {args.api_key_file} is empty")
        return lines[0].strip()
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def allowed_hosts(host: str, port: int, extra: list[str]) -> frozenset[str] | None:
    """The Host values the server answers: on loopback (or with --allowed-host), the loopback
    names at the port and the --allowed-host values as given; elsewhere, without
    --allowed-host, any (None)."""
    if host not in LOOPBACK and not extra:
        return None
    names = {f"{h}:{port}" for h in LOOPBACK_HOSTS}
    if port == DEFAULT_HTTP_PORT:
        names |= set(LOOPBACK_HOSTS)
    return frozenset(names | {h.lower() for h in extra})
