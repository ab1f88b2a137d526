"""The Ray Serve request router of the engine replicas (`forerun.cluster.routing` says how it
chooses). Ray Serve imports it by name in the ingress's process; this is the one module of
forerun that imports Ray at module level, and only `forerun.cluster.deploy` imports it, when it
deploys.
"""

from __future__ import annotations

import random

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from forerun.cluster.routing import KEY_ARG, rank


class PrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """A request's prefix replica first, then the next ranked; without a key, the less loaded
    of two random replicas."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get(KEY_ARG) if pending_request else None
        if key is None:  # the router asks both for their queue lengths, keeps the shorter
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i]] for i in rank(key, list(by_id))]
