"""What a replica is built from, and how the cluster is laid out: frozen, picklable records.

Owns: `EngineRecipe` (the engine a replica loads: model paths and configs, never the weights
themselves: each replica loads them in its own process, on its own node), `WorkerSettings` (the
server's limits, as `forerun serve` takes them), `ReplicaSpec` (both, plus the app's
`ServeConfig`), `ClusterConfig` (replicas, cores, a drafter's cores, address, ports) and
`pin_cores` (which CPUs a replica's threads run on). Imports neither Ray nor a model.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from forerun.api import DEFAULT_KV_BUDGET_BYTES, Engine, LoadConfig
from forerun.propose import SpecConfig
from forerun.serve.app import ServeConfig
from forerun.serve.limits import DEFAULT_QUEUE, DEFAULT_SLOTS
from forerun.serve.worker import LoadShedding

APP_NAME = "forerun"  # the Ray Serve application's name
HEALTH_CHECK_PERIOD_S = 2.0  # how often Ray Serve calls a replica's check_health
HEALTH_CHECK_TIMEOUT_S = 30.0  # a replica this long without answering is replaced
REPLICA_DRAFT_CORES = 1  # --disaggregate: a replica's drafter actor's CPUs


@dataclass(frozen=True)
class EngineRecipe:
    """`Engine(target, draft, spec=spec, load=load)`, built where it is called."""

    target: str
    draft: str | None
    spec: SpecConfig
    load: LoadConfig

    def __call__(self) -> Engine:
        return Engine(self.target, self.draft, spec=self.spec, load=self.load)


@dataclass(frozen=True)
class WorkerSettings:
    """`forerun.serve.worker.Worker`'s arguments, as `forerun serve`'s limits set them."""

    slots: int = DEFAULT_SLOTS
    max_queue: int = DEFAULT_QUEUE
    kv_cache_bytes: int = DEFAULT_KV_BUDGET_BYTES
    max_batch_tokens: int | None = None
    spec_policy: str = "adaptive"
    prefix_cache_bytes: int = 0
    lazy_kv: bool = True
    shedding: LoadShedding = field(default_factory=LoadShedding)
    calibrate: bool = True  # measure the speculation policies' curves before serving


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything one replica needs: `engine()` builds its engine in the replica's process (an
    `EngineRecipe`, or any picklable callable: tests pass slowed-down tiny models)."""

    engine: Callable[[], Engine]
    worker: WorkerSettings
    serve: ServeConfig


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    cores_per_replica: int = 1  # Ray CPUs a replica reserves, and the CPUs its threads use
    # an existing cluster ("auto", "ray://host:10001", "host:6379"); None = start a local one
    # on this machine with replicas x cores CPUs, stopped on exit
    address: str | None = None
    host: str = "127.0.0.1"  # where Ray Serve's HTTP proxy listens
    port: int = 8000
    prefix_routing: bool = True  # route by the prompt's first block (with prefix caching on)
    pin: bool = True  # pin each replica's threads to its own cores where they fit on its node
    # --disaggregate: each replica's drafter worker is a Ray actor on this many CPUs of its own,
    # in the replica's placement group (forerun.cluster.drafter_actor); 0: none
    draft_cores: int = 0
    strategy: str = "PACK"  # the replica's placement group (with draft_cores): PACK or SPREAD

    def __post_init__(self):
        if self.replicas < 1 or self.cores_per_replica < 1:
            raise ValueError(f"need replicas >= 1 and cores per replica >= 1, got "
                             f"{self.replicas} and {self.cores_per_replica}")
        if self.draft_cores < 0:
            raise ValueError(f"need draft cores >= 0, got {self.draft_cores}")

    @property
    def node_cores(self) -> int:
        """CPUs one replica takes: its target's, and its drafter's."""
        return self.cores_per_replica + self.draft_cores


def pin_cores(local_rank: int, cores: int) -> list[int] | None:
    """Pin this process to the `local_rank`-th group of `cores` CPUs it may run on, where there
    are that many (the replicas of one node then never share a core; llama.cpp and torch size
    their thread pools from the affinity). -> the CPUs, or None when they do not fit."""
    cpus = sorted(os.sched_getaffinity(0))
    group = cpus[local_rank * cores:(local_rank + 1) * cores]
    if len(group) < cores:
        return None
    os.sched_setaffinity(0, group)
    return group
