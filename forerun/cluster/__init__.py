"""Scale-out on Ray: `forerun serve --ray` deploys N engine replicas as a Ray Serve application
behind one OpenAI-compatible endpoint.

Owns nothing itself; its modules are
- `spec`: what a replica is built from (frozen, picklable records) and the cluster's settings;
- `asgi`: one HTTP request run through forerun's own app inside a replica, as messages;
- `routing`: the prefix key of a request; `router`: the request router that honours it;
- `replica`: the Ray Serve deployment around one `forerun.serve.worker.Worker`;
- `ingress`: the Ray Serve ingress: the gate, the routes, replica failures and retries;
- `deploy`: connecting to (or starting) a cluster, deploying, scaling, stopping.
- `drafter_actor`: the `--disaggregate` drafter worker as a Ray actor, placed with its target
  by a placement group (`--disaggregate --ray`, and each replica's under `serve --ray`).

Ray is an optional extra (`pip install forerun[cluster]`): only `router` imports it at module
level, and only `deploy` imports `router`, when it deploys; forerun imports and works without
it, and `--ray` says what to install.
"""
