"""Scale-out on Ray Serve: N engine replicas behind Ray Serve's HTTP proxy, with the same OpenAI routes.

Each replica is a Ray actor that builds its own model, engine and FastAPI app (`serve.ingress`, the app
made on the replica at start-up), so a request's tokens are those of the single-process server; Ray's
proxy spreads requests over the replicas. `/metrics` and `/health` answer for the replica that got
the request.

    infinigen serve --replicas 2                        # a local Ray cluster, started for the server
    RAY_ADDRESS=ray://head:10001 infinigen serve --replicas 8   # attach to a running cluster

From Python: `ray.init(address=...)`, then `serve.run(deployment(builder, replicas))`.
"""
from __future__ import annotations

import functools
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


def run(spec: dict, replicas: int, host: str = "127.0.0.1", port: int = 8000, blocking: bool = True) -> str:
    """Serve `spec` (the options of `infinigen serve`) with `replicas` replicas; RAY_ADDRESS (or a cluster
    this process already joined) is used when set, else a local cluster is started. Returns the URL."""
    try:
        import ray
        from ray import serve
    except ImportError:
        from ..errors import UserError
        raise UserError("--replicas needs Ray Serve: pip install 'infinigen[ray]'")
    from ..commands.serve import build
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
    if spec.get("fast_bytes") is None and not os.environ.get("RAY_ADDRESS"):
        from .engine import default_budgets
        from ..placement import Placement
        fast, _ = default_budgets(Placement(kv_offload=spec["kv_offload"], pool_dir=spec.get("pool_dir")), spec["device"])
        spec = {**spec, "fast_bytes": fast // replicas}  # replicas on one machine share its memory
    serve.start(http_options={"host": host, "port": port})
    serve.run(deployment(functools.partial(build, spec), replicas), name="infinigen", route_prefix="/")
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
