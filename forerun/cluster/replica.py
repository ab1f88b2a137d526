"""One engine replica: forerun's own worker and serve app inside a Ray Serve replica actor.

Owns: building the replica (pin its cores, load the engine from its `ReplicaSpec`, record the
decode passes, calibrate, start the worker), answering a forwarded HTTP request through the
unchanged serve app (`forerun.serve.app.create_app`: validation, tokenizing, the continuous
batch, SSE), `check_health` (Ray Serve calls it every HEALTH_CHECK_PERIOD_S and replaces a
replica whose worker has stopped) and stopping the worker when Ray Serve removes the replica.

Every response carries `x-forerun-replica: <replica id>` (which replica served it: tests, logs).
Ray is imported only inside the methods Ray Serve calls, so this module imports without it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import torch

from forerun.cluster.asgi import Forwarded, Start, call_app
from forerun.cluster.spec import ReplicaSpec, pin_cores
from forerun.serve.app import create_app
from forerun.serve.worker import Worker

log = logging.getLogger("forerun.cluster")
REPLICA_HEADER = "x-forerun-replica"


class WorkerStopped(RuntimeError):
    """The replica's worker has stopped for good: Ray Serve replaces the replica."""


class EngineReplica:
    def __init__(self, spec: ReplicaSpec, cores: int, pin: bool):
        from ray import serve

        self.worker: Worker | None = None  # until built: __del__ may run after a failed start
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        cpus = pin_cores(context.rank.local_rank, cores) if pin else None
        torch.set_num_threads(cores)
        engine = spec.engine()
        settings = spec.worker
        worker = self.worker = Worker(
            engine, slots=settings.slots, max_queue=settings.max_queue,
            kv_cache_bytes=settings.kv_cache_bytes, max_batch_tokens=settings.max_batch_tokens,
            spec_policy=settings.spec_policy, prefix_cache_bytes=settings.prefix_cache_bytes,
            lazy_kv=settings.lazy_kv, shedding=settings.shedding)
        worker.warm_up()
        if settings.calibrate:
            worker.calibrate()
        self.app = create_app(worker, spec.serve)
        worker.start()  # the app's lifespan is not run here: the replica owns the worker
        self.header = ((REPLICA_HEADER.encode(), self.replica_id.encode()),)
        log.info("replica %s serving on CPUs %s", self.replica_id, cpus or "unpinned")

    async def serve_http(self, request: Forwarded, prefix_key: str | None = None
                         ) -> AsyncIterator[Start | bytes]:
        """The response to `request`: a `Start`, then its body's chunks. `prefix_key` is the
        router's (forerun.cluster.routing), unused here."""
        async for part in call_app(self.app, request, self.header):
            yield part

    def check_health(self) -> None:
        if self.worker is None or not self.worker.alive:
            raise WorkerStopped(f"replica {self.replica_id}: its worker has stopped")

    def __del__(self) -> None:
        if self.worker is not None:
            self.worker.stop()
