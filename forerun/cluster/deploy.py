"""Deploying forerun on a Ray cluster: connect (or start a local one), deploy, scale, stop.

Owns: the Ray Serve application `forerun` (APP_NAME): an `Ingress` deployment (one replica, no
CPU of its own; Ray Serve's HTTP proxy on `host:port` in front of it) and an `EngineReplica`
deployment of `replicas` replicas with `cores_per_replica` CPUs each, routed by
`forerun.cluster.router.PrefixRouter` and health-checked every HEALTH_CHECK_PERIOD_S. With
`draft_cores` (`--disaggregate`), each replica is deployed in a placement group of its own: its
target's bundle (the replica) and its drafter actor's (`replica_placement`), PACKed on one node
or SPREAD; the replica pins its threads to the target's and the drafter's cores together and
the engine splits them (the drafter the last `draft_cores`). Deploying
again under the same name updates the running application in place: another replica count
scales it (Ray Serve starts or stops replicas; the others keep serving).

A local cluster (no address) is Ray on this machine alone: `replicas x node_cores` CPUs, no
dashboard, a small object store (responses stream as small objects), shut down with the
application. Only the HTTP endpoint is bound to `host` (127.0.0.1 by default): Ray's own
processes (GCS, raylet, workers) listen on every interface whatever they are told (Ray turns a
loopback node address into the machine's), guarded by Ray's token authentication, which Ray
2.60 turns on for a local cluster; firewall their ports where the network is shared.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from forerun.cluster.drafter_actor import DrafterPlacement
from forerun.cluster.ingress import ENGINE_DEPLOYMENT, Ingress
from forerun.cluster.replica import EngineReplica
from forerun.cluster.spec import (
    APP_NAME,
    HEALTH_CHECK_PERIOD_S,
    HEALTH_CHECK_TIMEOUT_S,
    ClusterConfig,
    ReplicaSpec,
)

log = logging.getLogger("forerun.cluster")
OBJECT_STORE_BYTES = 128 << 20  # a local cluster's object store: streamed chunks are small
INGRESS_SLOTS_PER_REPLICA = 4  # the ingress takes this many times the replicas' own limits
MISSING = ("Ray is not installed: pip install 'forerun[cluster]' (ray[serve]) on every node of "
           "the cluster")


@dataclass(frozen=True)
class Cluster:
    """A connection to a Ray cluster; `local`: this process started it and stops it."""

    address: str
    local: bool


def connect(config: ClusterConfig) -> Cluster:
    """Join the cluster at config.address, or start a local one on this machine."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(MISSING) from e
    if config.address is not None:
        context = ray.init(address=config.address, log_to_driver=False)
        return Cluster(context.address_info["address"], local=False)
    context = ray.init(num_cpus=config.replicas * config.node_cores,
                       include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                       log_to_driver=False)
    return Cluster(context.address_info["address"], local=True)


def deploy(spec: ReplicaSpec, config: ClusterConfig) -> None:
    """Deploy (or update in place) the application; returns once every replica is running."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from forerun.cluster.router import PrefixRouter

    serve.start(http_options={"host": config.host, "port": config.port})
    per_replica = spec.worker.slots + spec.worker.max_queue  # beyond: the worker's own 429
    engines = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=config.replicas,
        ray_actor_options={"num_cpus": config.cores_per_replica},
        max_ongoing_requests=per_replica, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter),
        **replica_placement(config))
    ingress = serve.deployment(
        serve.ingress()(Ingress), name="Ingress", num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_SLOTS_PER_REPLICA * per_replica * config.replicas)
    app = ingress.bind(engines.bind(spec, config.node_cores, config.pin), spec.serve,
                       config.prefix_routing)
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)


def replica_placement(config: ClusterConfig) -> dict:
    """A replica's placement group, as Ray Serve's deployment options: with a drafter, the
    replica's target bundle (where Ray Serve runs the replica) and its drafter's, which
    `forerun.cluster.drafter_actor` fills from inside the replica; without one, none."""
    if not config.draft_cores:
        return {}
    placement = DrafterPlacement(config.draft_cores, config.cores_per_replica, config.strategy)
    return {"placement_group_bundles": placement.bundles(),
            "placement_group_strategy": placement.strategy}


def stop(cluster: Cluster) -> None:
    """Remove the application; shut a local cluster down (a joined one keeps running)."""
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        if cluster.local:
            serve.shutdown()
    finally:
        ray.shutdown()


def serve_until_stopped(spec: ReplicaSpec, config: ClusterConfig, detach: bool = False,
                        on_ready: Callable[[Cluster], None] | None = None) -> Cluster:
    """Connect, deploy, call `on_ready` and (unless `detach`) serve until SIGINT/SIGTERM,
    then stop."""
    cluster = connect(config)
    try:
        deploy(spec, config)
    except BaseException:
        stop(cluster)
        raise
    if on_ready is not None:
        on_ready(cluster)
    if detach:
        return cluster
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        stopped.wait()
    finally:
        stop(cluster)
    return cluster
