"""`infinigen serve`: the OpenAI-compatible server (one process with uvicorn, or N replicas on Ray Serve).

Every option is checked before the model is loaded. See `infinigen.serve` for the engine and the API.
"""
from __future__ import annotations

import re
import sys
from typing import Optional

import typer

from ..errors import UserError
from ..policies import REGISTRY
from .options import (check_model_options, check_policies_fit, check_range, device_option, dtype_option,
                      knob_option, make_policy_from_cli, model_option, prepare_policies)
from .placement_opts import parse_bytes

OFFLOADS = ("none", "cpu", "disk")


def serve_cmd(
    model: str = model_option(),
    policy: str = typer.Option("full", "--policy", help=f"KV-cache policy: {', '.join(REGISTRY)}."),
    knob: list[str] = knob_option(),
    kv_offload: str = typer.Option("none", "--kv-offload", help="Where the KV pool lives: none (fast memory), cpu "
                                   "(host memory behind a GPU), disk (memory-mapped files)."),
    pool_dir: Optional[str] = typer.Option(None, "--pool-dir", help="Folder of the disk pool's files (default: temp dir)."),
    pool_bytes: Optional[str] = typer.Option(None, "--pool-bytes", help="KV pool budget in the tier that holds it "
                                             "(e.g. 8G). Default: a quarter of RAM (none), half of RAM (cpu), half "
                                             "of the free disk (disk)."),
    fast_bytes: Optional[str] = typer.Option(None, "--fast-bytes", help="Fast-memory budget for the KV and what "
                                             "requests hold there (fetched rows, policy state). Default: a quarter "
                                             "of the device's memory."),
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together at most."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for KV memory at most; beyond: 429."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients ask for "
                                       "(default: the model's name)."),
    replicas: int = typer.Option(1, "--replicas", help="Engine replicas; more than 1 runs them on Ray Serve "
                                 "(RAY_ADDRESS attaches to a running cluster)."),
    device: str = device_option(),
    dtype: str = dtype_option(),
):
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching."""
    check_model_options(device, dtype)
    if kv_offload not in OFFLOADS:
        raise UserError(f"--kv-offload must be one of {', '.join(OFFLOADS)}, got {kv_offload!r}")
    check_range("max-batch", max_batch, lo=1)
    check_range("max-queue", max_queue, lo=0)
    check_range("port", port, lo=0, hi=65535)
    check_range("replicas", replicas, lo=1)
    budgets = dict(pool_bytes=parse_bytes(pool_bytes), fast_bytes=parse_bytes(fast_bytes, "fast-bytes"))
    make_policy_from_cli(policy, knob)  # knobs checked now, before loading
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"serving needs the 'serve' extra: pip install 'infinigen[serve]' ({e.name} is missing)")
    spec = dict(model=model, policy=policy, knob=list(knob), kv_offload=kv_offload, pool_dir=pool_dir,
                max_batch=max_batch, max_queue=max_queue, name=name, device=device, dtype=dtype, **budgets)
    if replicas > 1:
        import functools

        from ..placement import Placement
        from ..serve.ray import replica_fast_bytes, run
        if spec["fast_bytes"] is None:
            spec["fast_bytes"] = replica_fast_bytes(Placement(kv_offload=kv_offload, pool_dir=pool_dir), device, replicas)
        run(functools.partial(build, spec), replicas=replicas, host=host, port=port)
        return
    import uvicorn
    app = build(spec)
    engine = app.state.engine
    print(f"infinigen: serving {app.state.model_name} on http://{host}:{port}/v1 ({engine.describe()})", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def build(spec: dict):
    """Load the model and make the app (also what every Ray Serve replica runs)."""
    from ..generate import stop_ids
    from ..placement import Placement
    from ..serve.app import create_app
    from ..serve.engine import Engine
    from .basic import load_model
    pol = make_policy_from_cli(spec["policy"], spec["knob"])
    net, tok, name = load_model(spec["model"], spec["dtype"], spec["device"])
    check_policies_fit(pol, net)
    prepare_policies({spec["policy"]: pol}, net, tok)
    engine = Engine(net, pol, Placement(kv_offload=spec["kv_offload"], pool_dir=spec["pool_dir"]),
                    eos=stop_ids(net, tok), max_batch=spec["max_batch"], max_queue=spec["max_queue"],
                    fast_bytes=spec["fast_bytes"], pool_bytes=spec["pool_bytes"])
    served = spec.get("name") or re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")  # URL- and shell-friendly
    app = create_app(engine, tok, served)
    app.state.model_name = served
    return app


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
