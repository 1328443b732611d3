"""Scale-out on Ray Serve: N engine replicas behind Ray Serve's HTTP proxy, with the same OpenAI routes.

Each replica is a Ray actor that builds its own model, engine and FastAPI app (`serve.ingress`, the app
made on the replica at start-up), so a request's tokens are those of the single-process server; Ray's
proxy spreads requests over the replicas. `/metrics` and `/health` answer for the replica that got
the request.

    infinigen serve --replicas 2                        # a local Ray cluster, started for the server
    RAY_ADDRESS=ray://head:10001 infinigen serve --replicas 8   # attach to a running cluster

From Python: `ray.init(address=...)`, then `serve.run(deployment(builder, replicas))`, or `run(builder,
replicas)`; `builder` is any picklable callable that returns the FastAPI app (`infinigen serve` passes
`functools.partial(commands.serve.build, config)`, a `ServerConfig`), so this module knows nothing of the command line.
"""
from __future__ import annotations

import os
import sys
from typing import Callable


def deployment(builder: Callable, replicas: int, name: str = "infinigen", num_cpus: float = 1.0):
    """A bound Ray Serve deployment of `replicas` replicas, each serving the FastAPI app `builder()` returns.
    `builder` runs on the replica (it loads the model there), so it must pickle: a module-level function
    or a functools.partial of one."""
    from ray import serve

    @serve.ingress()  # the app is built on each replica, after __init__
    class Replica:
        def __init__(self, build):
            self._build = build

        def __serve_build_asgi_app__(self):
            return self._build()

    return serve.deployment(Replica, name=name, num_replicas=replicas,
                            ray_actor_options={"num_cpus": num_cpus}).bind(builder)


def replica_fast_bytes(placement, device, replicas: int) -> int | None:
    """Each replica's fast-memory budget when none is given and the replicas share this machine (no
    RAY_ADDRESS): the default budget split between them; None (each replica's own default) otherwise."""
    if os.environ.get("RAY_ADDRESS"):
        return None
    from .engine import default_budgets
    fast, _ = default_budgets(placement, device)
    return fast // replicas


def run(builder: Callable, replicas: int, host: str = "127.0.0.1", port: int = 8000, blocking: bool = True) -> str:
    """Serve the app `builder()` makes on each of `replicas` replicas; RAY_ADDRESS (or a cluster this process
    already joined) is used when set, else a local cluster is started. Returns the URL."""
    try:
        import ray
        from ray import serve
    except ImportError:
        from ..errors import UserError
        raise UserError("serving on several replicas needs Ray Serve: pip install 'infinigen[ray]'")
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(builder, replicas), name="infinigen", route_prefix="/")
    url = f"http://{host}:{port}"
    print(f"infinigen: {replicas} replicas on Ray Serve at {url}/v1", file=sys.stderr)
    if blocking:
        import time
        try:
            while True:
                time.sleep(3600)
        finally:
            serve.shutdown()
    return url
