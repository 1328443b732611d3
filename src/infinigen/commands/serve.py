"""`infinigen serve`: the OpenAI-compatible server (one process with uvicorn, or N replicas on Ray Serve).

Every option is checked before the model is loaded. The port is bound and served first: while the model
loads, the policy prepares (calibration) and the step compiles, every route answers 503 with a Retry-After
(`infinigen.serve.app.WarmingUp`) and stderr says which step runs; then the app serves. A failure while warming
up is one line: exit 2 when the user's input or environment caused it (a model that does not load, budgets
that cannot hold a request), exit 1 otherwise. SIGTERM stops accepting connections, lets the running requests
finish (streams for up to `infinigen.serve.app.DRAIN_S` seconds) and exits 0; SIGINT cancels them and exits 130;
a second signal exits at once; either during the warm-up exits at once (0 / 130). See `infinigen.serve` for the
engine and the API.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from ..cli import exit_on_sigterm, raise_a_swallowed_stop, stop_native_builds, stopping
from ..errors import UserError
from ..policies import REGISTRY
from ..serve.config import ServerConfig
from .options import (check_compile_option, check_model_options, check_policies_fit, compile_option,
                      device_option, dtype_option, enable_compile, knob_option, make_policy_from_cli, model_option,
                      prepare_policies, resolve_dtype)
from .placement_opts import parse_bytes


def serve_cmd(
    ctx: typer.Context,
    model: str = model_option(),
    policy: str = typer.Option("full", "--policy", help=f"KV-cache policy: {', '.join(REGISTRY)}."),
    knob: list[str] = knob_option(),
    kv_offload: str = typer.Option("none", "--kv-offload", help="Where the KV pool lives: none (fast memory), cpu "
                                   "(host memory behind a GPU), disk (memory-mapped files)."),
    pool_dir: Optional[str] = typer.Option(None, "--pool-dir", help="Folder of the disk pool's files (default: temp dir)."),
    disk_block: int = typer.Option(0, "--disk-block", help="With --kv-offload disk: each request's pool in "
                                   "page-aligned blocks of this many tokens per layer and KV head, read with "
                                   "positioned reads of the blocks a selection names (e.g. 16); 0: a memory-mapped "
                                   "file."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Serve under this memory bound (e.g. "
                                               "1.5G; a cgroup, as root), page cache included; the fast-memory "
                                               "budget defaults to half of what it leaves beside the loaded "
                                               "server. Default: the limit of the cgroup the server runs in, if "
                                               "any."),
    pool_bytes: Optional[str] = typer.Option(None, "--pool-bytes", help="KV pool budget in the tier that holds it "
                                             "(e.g. 8G). Default: a quarter of RAM (none), half of RAM (cpu), half "
                                             "of the free disk (disk)."),
    fast_bytes: Optional[str] = typer.Option(None, "--fast-bytes", help="Fast-memory budget for the KV and what "
                                             "requests hold there (fetched rows, policy state). Default: a quarter "
                                             "of the device's memory."),
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together at most."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for KV memory at most; beyond: 429."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Reuse the KV of prompt "
                                      "prefixes that requests share (a document, a system prompt, a chat's "
                                      "history) in blocks of 256 tokens; for policies whose state a continued "
                                      "prefill rebuilds exactly, with the KV in fast memory."),
    prefix_cache_bytes: Optional[str] = typer.Option(None, "--prefix-cache-bytes", help="The prefix cache's "
                                                     "limit (LRU beyond it). Default: an eighth of the fast "
                                                     "budget."),
    prefix_cache_dir: Optional[str] = typer.Option(None, "--prefix-cache-dir", help="Folder where the prefix "
                                                   "cache's blocks persist (a safetensors file each): a restarted "
                                                   "server reads them back. Default: none, the cache lives in "
                                                   "memory only (the KV pool's --pool-dir is not reused)."),
    prefix_cache_dir_bytes: Optional[str] = typer.Option(None, "--prefix-cache-dir-bytes", help="The folder's "
                                                         "limit (least recently used files deleted beyond it). "
                                                         "Default: 4x --prefix-cache-bytes."),
    prefill_chunk_layers: int = typer.Option(1, "--prefill-chunk-layers", help="A prompt that joins running "
                                             "requests is prefilled this many layers per decode step, so their "
                                             "pace holds (0: the whole prompt at once)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients ask for "
                                       "(default: the model's name)."),
    replicas: int = typer.Option(1, "--replicas", help="Engine replicas; more than 1 runs them on Ray Serve "
                                 "(RAY_ADDRESS attaches to a running cluster)."),
    device: str = device_option(),
    dtype: str = dtype_option(),
    compile: str = compile_option("with --no-batch-invariant, on where it runs: a CPU with a C++ compiler; "
                                  "compiled for every batch size up to --max-batch while the server warms up"),
    decode_threads: Optional[int] = typer.Option(None, "--decode-threads", help="Torch threads a decoding step "
                                                 "runs on. Default on a CPU: all of torch's threads but one, at "
                                                 "least one, so the HTTP thread and the KV stores' workers keep a "
                                                 "core while a step runs; prompts are prefilled on all of them."),
    batch_invariant: bool = typer.Option(True, "--batch-invariant/--no-batch-invariant", help="A request's "
                                         "greedy tokens do not depend on the requests decoded beside it: each "
                                         "one's attention is its own call and the step runs eagerly (not "
                                         "compiled). --no-batch-invariant: one padded attention call over every "
                                         "request and the compiled step, faster, but in bfloat16 a request's "
                                         "tokens may then change with the batch."),
):
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching."""
    check_model_options(device, dtype)
    check_compile_option(compile)
    limit = parse_bytes(memory_limit, "memory-limit")
    config = ServerConfig(
        model=model, policy=policy, knobs=tuple(knob), kv_offload=kv_offload, pool_dir=pool_dir,
        disk_block=disk_block, memory_limit=limit, pool_bytes=parse_bytes(pool_bytes),
        fast_bytes=parse_bytes(fast_bytes, "fast-bytes"),
        max_batch=max_batch, max_queue=max_queue, prefix_cache=prefix_cache,
        prefix_cache_bytes=parse_bytes(prefix_cache_bytes, "prefix-cache-bytes"), prefix_cache_dir=prefix_cache_dir,
        prefix_cache_dir_bytes=parse_bytes(prefix_cache_dir_bytes, "prefix-cache-dir-bytes"),
        prefill_chunk_layers=prefill_chunk_layers, host=host, port=port, served_model_name=name,
        replicas=replicas, device=device, dtype=dtype, compile=compile, batch_invariant=batch_invariant,
        decode_threads=decode_threads)
    from ..membound import current
    _start(ctx, config, bounded=current() is not None)  # a parent process re-ran this one under the bound


def _start(ctx, config: ServerConfig, bounded: bool) -> None:
    """Everything checked that can be before loading, then the server: here, on Ray, or re-run under the
    memory bound (`bounded`: this process is that re-run)."""
    if config.prefix_cache_dir is not None:
        config = dataclasses.replace(config, prefix_cache_dir=_check_prefix_dir(config.prefix_cache_dir))
    make_policy_from_cli(config.policy, list(config.knobs))  # knobs checked now, before loading
    try:
        import fastapi  # noqa: F401
        import sse_starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"serving needs the 'serve' extra: pip install 'infinigen[serve]' ({e.name} is missing)")
    if config.kv_offload == "disk":  # a folder that cannot hold a pool file: said now, before loading
        from ..placement.tiers import check_pool_folder
        check_pool_folder(config.pool_dir)
    if config.replicas > 1:
        _serve_on_ray(config)
        return
    if config.memory_limit is not None and not bounded:
        _check_memory_bound(config)  # before a group is made and a child started
        from .. import membound
        code = membound.serve_bounded(ctx, ["serve"], config.memory_limit)
        if code:
            raise typer.Exit(code if code in (2, 130) else 1)
        return
    _serve_here(config)


def _serve_on_ray(config: ServerConfig) -> None:
    """`--replicas N`: the budgets checked here, then N replicas that each build the app on Ray Serve."""
    import functools

    from ..placement import Placement
    from ..serve.ray import replica_fast_bytes, run
    listener = _listen(config.host, config.port)
    with _sigterm_exits():
        try:
            _check_budgets(config)
        finally:
            listener.close()  # Ray Serve's proxy binds the port itself
        if config.fast_bytes is None:
            placement = Placement(kv_offload=config.kv_offload, pool_dir=config.pool_dir)
            config = dataclasses.replace(config, fast_bytes=replica_fast_bytes(placement, config.device,
                                                                               config.replicas))
        run(functools.partial(build, config), replicas=config.replicas, host=config.host, port=config.port)


def _serve_here(config: ServerConfig) -> None:
    """One process: the port served at once (503 while warming up), then the app until a signal stops it."""
    from ..serve.app import WarmingUp
    listener = _listen(config.host, config.port)
    gate = WarmingUp()
    server = _Server(gate, listener, config.host)  # answers every route with 503 while the model loads
    url = f"http://{config.host}:{listener.getsockname()[1]}"  # --port 0: the one the system chose

    def phase(name: str, line: str) -> None:
        gate.phase = name
        print(f"infinigen: loading: {line}", file=sys.stderr, flush=True)

    try:
        with _sigterm_exits():
            _check_budgets(config)
            _check_memory_bound(config)
            try:
                app = build(config, phase=phase, url=url)
            except (UserError, KeyboardInterrupt, OSError):
                raise  # the CLI's one line: the user's input or environment (2), or Ctrl-C (130)
            except Exception as e:  # noqa: BLE001 -- not the user's fault: one line and exit 1, not a traceback
                if stopping():
                    raise  # a signal's exception that a library turned into another: the CLI exits as it asks
                print(f"infinigen: error: warming up failed: {type(e).__name__}: {' '.join(str(e).split())}"[:500],
                      file=sys.stderr)
                raise typer.Exit(1)
            raise_a_swallowed_stop()  # a signal during the warm-up whose exception a library dropped: stop now
    except BaseException:
        server.stop()
        raise
    gate.ready(app)
    described = ", ".join(filter(None, [app.state.engine.describe(), app.state.compiled_note,
                                        app.state.bound_note]))
    print(f"infinigen: serving {app.state.model_name} on {url}/v1 ({described})", file=sys.stderr, flush=True)
    stopped_by = server.wait(app.state.engine)
    if stopped_by == signal.SIGINT:
        raise KeyboardInterrupt  # the CLI's Ctrl-C: exit 130
    stop_native_builds()  # SIGTERM soon after the start: the exit does not wait for a build still in flight


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet: nobody connects to a server that is still loading), as
    uvicorn would bind it; a busy or unbindable address is a UserError before anything is loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
        sock.bind((host, port))
    except OSError as e:  # in use, not an address of this machine, privileged, unknown host name
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}")
    return sock


def _check_prefix_dir(folder: str) -> str:
    """--prefix-cache-dir: a folder (made now if missing) that this process can write files in."""
    import tempfile
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"--prefix-cache-dir {folder} is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise UserError(f"--prefix-cache-dir {folder} is not writable: {e.strerror or e}")
    return str(path)


def _check_budgets(config: ServerConfig) -> None:
    """--fast-bytes and --pool-bytes must hold one token's KV of this model (read from its config, before the
    weights): a server that can never admit a request is refused. What a request holds beyond its KV (policy
    state, fetched rows) is measured once the model is loaded (`Engine.check_fits`)."""
    if config.fast_bytes is None and config.pool_bytes is None:
        return
    from types import SimpleNamespace

    from ..loading import resolve_precision
    from ..placement import kv_slot_bytes
    cfg = _model_config(config.model)
    if cfg is None:
        return  # loading says what is wrong with the model
    pol = make_policy_from_cli(config.policy, list(config.knobs))
    offload = config.kv_offload
    dtype, _ = resolve_precision(config.dtype, "auto", config.device or "cpu")  # "auto" -> what loading picks
    per = kv_slot_bytes(SimpleNamespace(cfg=cfg, dtype=dtype), 1, pol, offload)
    if offload == "none":  # the pool is in fast memory: both limits bound it
        given = [(name, value) for name, value in (("fast-bytes", config.fast_bytes),
                                                   ("pool-bytes", config.pool_bytes)) if value is not None]
    else:
        given = [("pool-bytes", config.pool_bytes)] if config.pool_bytes is not None else []
    for name, value in given:
        if value < per:
            where = "fast memory" if offload == "none" else f"the {offload} pool"
            raise UserError(f"--{name} {value} bytes cannot hold one token's KV in {where}: a token takes {per} "
                            f"bytes with this model ({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads of "
                            f"{cfg.head_dim}, {str(dtype).removeprefix('torch.')})")


def _check_memory_bound(config: ServerConfig) -> None:
    """Under a memory bound (--memory-limit or a cgroup's): refused before loading when the bound cannot hold
    this process, the model's weights and one request's fast state."""
    from ..loading import default_gguf, resolve_precision
    from ..memory import resident_bytes
    from ..serve.bound import check_before_loading, request_fast_floor, server_bound, weights_bytes
    bound = server_bound(config.memory_limit)
    cfg = _model_config(config.model)
    if bound is None or cfg is None:
        return  # loading says what is wrong with the model
    dtype, mode = resolve_precision(config.dtype, "auto", config.device or "cpu")
    element = dtype.itemsize
    path = default_gguf() if config.model in ("", "default") else Path(config.model).expanduser()
    if path.is_dir():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    gguf = path if path.is_file() and path.suffix == ".gguf" else None
    check_before_loading(bound, resident_bytes() or 0, weights_bytes(cfg, gguf, element, mode),
                         request_fast_floor(cfg, element, config.disk_block))


def _model_config(model: str):
    """The model's shape from its config.json, without its weights (a GGUF file: its cached conversion, made
    now if needed, as loading would); None when there is none to read."""
    from transformers import AutoConfig

    from ..config import ModelConfig
    from ..loading import convert_gguf, default_gguf
    path = default_gguf() if model in ("", "default") else Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").exists():
        path = next(iter(sorted(path.glob("*.gguf"))), path)
    try:
        if path.is_file() and path.suffix == ".gguf":
            path = convert_gguf(path, progress=False)
        return ModelConfig.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, UserError):
        return None


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM before serving starts (the model loading): exit 0 now, there is nothing to drain."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Server:
    """uvicorn serving `app` on `listener` from a thread of its own, started now, so the main thread can load
    the model meanwhile and keeps the signals."""

    def __init__(self, app, listener: socket.socket, host: str):
        import uvicorn

        from ..serve.app import DRAIN_S
        # the streams' own grace period (DRAIN_S) ends first: they are cut by the app, not by uvicorn
        config = uvicorn.Config(app, host=host, port=listener.getsockname()[1], log_level="warning",
                                timeout_graceful_shutdown=DRAIN_S + 5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]}, name="infinigen-http",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop at once (nothing is being served yet: the model did not load)."""
        self.server.should_exit = self.server.force_exit = True
        self.thread.join(timeout=60)

    def wait(self, engine) -> int | None:
        """Serve until a signal stops the server; returns that signal. SIGTERM drains: no new connections,
        running requests finish (streams are cut after DRAIN_S). SIGINT cancels the running requests at once
        (their clients get an error). A second signal stops without waiting."""
        received: list[int] = []
        server = self.server

        def on_signal(sig, frame):
            received.append(sig)
            if server.should_exit:
                server.force_exit = True
            server.should_exit = True
            if sig == signal.SIGINT:
                engine.cancel_all()

        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self.thread.is_alive():
                self.thread.join(timeout=0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return received[0] if received else None


def _serve(app, listener: socket.socket, host: str, port: int) -> int | None:
    """uvicorn serving the (loaded) `app` on `listener` until a signal stops it; returns that signal."""
    return _Server(app, listener, host).wait(app.state.engine)


def build(config: ServerConfig, phase=None, url: str | None = None):
    """Load the model and make the app (also what every Ray Serve replica runs). `phase(name, line)` hears
    each step as it starts: "model", "calibrating" (the policy's `prepare`), "compiling" (once per batch
    size); `url`: where the server answers meanwhile, for the first line."""
    from ..generate import stop_ids
    from ..serve.app import create_app
    from ..serve.engine import Engine
    from .basic import load_model
    phase = phase or (lambda name, line: None)
    pol = make_policy_from_cli(config.policy, list(config.knobs))
    label = "the default model" if config.model in ("", "default") else config.model
    waiting = f" (503 on {url} until ready)" if url else ""
    phase("model", f"model: {label} ({resolve_dtype(config.dtype, config.device or 'cpu')}){waiting}")
    net, tok, name = load_model(config.model, config.dtype, config.device)
    check_policies_fit(pol, net)
    phase("calibrating", f"calibrating: preparing the {config.policy} policy")
    pol = prepare_policies({config.policy: pol}, net, tok)[config.policy]
    bound_note = _budget_under_bound(config)
    if bound_note is not None:
        config = dataclasses.replace(config, fast_bytes=bound_note[0])
    phase("model", "model: measuring what a request holds")
    engine = Engine.from_config(net, pol, config, eos=stop_ids(net, tok))
    try:
        engine.check_fits(1, 1)
    except UserError as e:
        raise UserError(f"the KV budgets cannot hold a request of one prompt token and one new token: {e}")
    # compiled once the engine accepted the budgets, for every batch size it can decode (a power of two
    # covers those below it: rows are padded)
    sizes = [1 << i for i in range(7) if 1 << i < 2 * config.max_batch]  # up to compiled.MAX_BUCKET

    def compiling(i: int, rows: int) -> None:
        phase("compiling", f"compiling: the decoding step for {rows} rows ({i + 1} of {len(sizes)})")
    compiled_note = enable_compile(net, config.compile_mode, long_running=True, rows=sizes, progress=compiling)
    served = config.served_model_name or re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")  # URL-friendly
    app = create_app(engine, tok, served)
    app.state.model_name = served
    app.state.compiled_note = compiled_note
    app.state.bound_note = bound_note[1] if bound_note is not None else None
    return app


def _budget_under_bound(config: ServerConfig) -> tuple[int, str] | None:
    """Under a memory bound and without --fast-bytes: (the fast budget it leaves beside the loaded server,
    a line saying so); None otherwise."""
    from ..memory import map_large_allocations, resident_bytes
    from ..serve.bound import fast_budget_under, server_bound
    bound = server_bound(config.memory_limit)
    if bound is None:
        return None
    map_large_allocations()  # a prompt's freed activations go back to the OS at once, not at the next trim
    if config.fast_bytes is not None:
        return None
    resident = resident_bytes() or 0
    fast = fast_budget_under(bound, resident)
    gib = 2 ** 30
    return fast, (f"under {bound[1]} of {bound[0] / gib:.2f} GiB (the loaded server {resident / gib:.2f} GiB, "
                  f"fast budget {fast / gib:.2f} GiB)")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_cmd)
