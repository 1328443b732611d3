"""`infinigen bench`: decode speed of KV-cache systems side by side (FlexGen-like flags).

    infinigen bench --prompt-len 2048 --gen-len 32 --batch-size 4,8 --policy full,infinigen,h2o,int4 \\
        --kv-offload cpu --json out.json --plot out.png

Systems: every --policy on every --kv-offload tier ("full" on a slow tier is FlexGen-style full offload),
plus "ideal" (full cache in fast memory) and transformers' DynamicCache on the same weights (and its
offloaded DynamicCache on CUDA). Policy settings: `--knob NAME=VALUE` (or POLICY.NAME=VALUE).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple, Optional

import typer

from ..errors import UserError
from .options import (FLOAT, MAX_ROWS, check_compile_option, check_kv_fits, check_model_options, check_out_file,
                      check_policies_fit, check_range, check_weights_option, compile_option, device_option,
                      dtype_option, enable_compile, knob_option, model_option, parse_policies, plot_formats,
                      prepare_policies, weights_option, write_json)
from .placement_opts import (CORRECT, EVICT, POOL_BYTES, POOL_DIR, READ_IN_PLACE, ROW_CACHE_BYTES, check_read_in_place,
                             parse_bytes, parse_size)


def _int_list(name: str, text: str) -> list[int]:
    try:
        vals = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise UserError(f"--{name} expects integers separated by commas, got {text!r}")
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"--{name} values must be >= 1, got {text!r}")
    return vals


def bench_cmd(
    ctx: typer.Context,
    model: str = model_option(),
    synthetic: Optional[str] = typer.Option(None, "--synthetic",
                                            help="Random weights of a paper-size shape instead of --model: opt-6.7b, "
                                                 "opt-13b, opt-30b, llama-2-7b, llama-2-13b, llama-3-8b, smollm2-135m."),
    layers: Optional[int] = typer.Option(None, "--layers", help="--synthetic: fewer layers than the real shape."),
    fixed_ratio: Optional[float] = typer.Option(None, "--fixed-ratio", **FLOAT,
                                                help="--synthetic: InfiniGen fetches this share of the tokens per step "
                                                     "(the relative KV size measured on the real model)."),
    prompt_len: str = typer.Option("2048", "--prompt-len", help="Prompt lengths, comma separated (a sweep)."),
    gen_len: int = typer.Option(32, "--gen-len", help="Tokens generated per sequence (the first comes from prefill)."),
    batch_size: str = typer.Option("4", "--batch-size", help="Batch sizes, comma separated (a sweep)."),
    policy: str = typer.Option("full,infinigen", "--policy", help="Policies, comma separated: full, infinigen, h2o, int4, streaming."),
    kv_offload: str = typer.Option("cpu", "--kv-offload", help="KV tiers, comma separated: none, cpu, disk."),
    knob: list[str] = knob_option(),
    ideal: bool = typer.Option(True, "--ideal/--no-ideal", help="Also run the full cache in fast memory."),
    hf: bool = typer.Option(True, "--transformers/--no-transformers", help="Also run transformers' DynamicCache."),
    capacity: Optional[int] = typer.Option(None, "--capacity", help="KV pool limit in tokens per sequence."),
    pool_bytes: Optional[str] = POOL_BYTES,
    eviction: str = EVICT,
    pool_dir: Optional[Path] = POOL_DIR,
    row_cache_bytes: Optional[str] = ROW_CACHE_BYTES,
    prefetch: bool = typer.Option(True, "--prefetch/--no-prefetch", help="Fetch layer i+1's rows during layer i."),
    correct: bool = CORRECT,
    read_in_place: Optional[bool] = READ_IN_PLACE,
    weights_offload: float = typer.Option(0.0, "--weights-offload", **FLOAT, help="Share of the layers whose weights stay in the "
                                          "slow tier and stream per layer (FlexGen's weight percentage)."),
    share_prefill: bool = typer.Option(False, "--share-prefill", help="One real prefill per (length, batch), replayed into "
                                       "every system (long prompts on a CPU); decoding is unchanged."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch intra-op threads (CPU)."),
    breakdown: int = typer.Option(0, "--breakdown", help="Extra instrumented steps for a per-layer time breakdown (0: off)."),
    count_ops: bool = typer.Option(False, "--count-ops", help="One extra step under the torch profiler: its aten "
                                   "operator calls (after the timed steps)."),
    text: str = typer.Option("prideprejudice", "--text", help="Prompt text: a file or a bundled corpus name."),
    device: str = device_option(),
    dtype: str = dtype_option(),
    weights: str = weights_option(),
    compile: str = compile_option("on where it runs: a CPU with a C++ compiler; compiled before the timed steps"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write all rows to this JSON file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: decode throughput vs batch size and vs length."),
    memory_limit: Optional[str] = typer.Option(None, "--memory-limit", help="Run under this memory bound (e.g. 2G; a cgroup "
                                               "as root) so the page cache cannot hold a disk pool; reported with the rows."),
):
    """Prefill/decode latency, throughput, bytes moved, peak memory: policies x KV tiers x sweeps."""
    from .. import bench, membound
    if memory_limit is not None and membound.current() is None:
        code = membound.rerun_bounded(ctx, ["bench"], parse_bytes(memory_limit, "memory-limit"))
        if code:
            raise typer.Exit(2 if code == 2 else 1)
        return
    prompt_lens, batch_sizes, tiers, names = _check_sweep(prompt_len, batch_size, gen_len, capacity, kv_offload,
                                                          policy)
    read_in_place = _check_options(synthetic, layers, fixed_ratio, breakdown, threads, weights_offload, device, dtype,
                                   weights, compile, eviction, read_in_place, tiers)
    limit = parse_bytes(pool_bytes)
    row_cache = parse_size(row_cache_bytes, "row-cache-bytes") or 0
    policies = parse_policies(names, knob)
    if synthetic:
        for pol in policies.values():
            pol.for_random_weights(None, fixed_ratio)  # checked before the random weights are built
    check_out_file(json_out, "--json")
    check_out_file(plot_out, "--plot", suffixes=plot_formats())
    settings = bench.BenchSettings(prompt_lens=prompt_lens, batch_sizes=batch_sizes, gen_len=gen_len, capacity=capacity,
                                   pool_bytes=limit, eviction=eviction, pool_dir=str(pool_dir) if pool_dir else None,
                                   prefetch=prefetch, breakdown_steps=breakdown, count_ops=count_ops,
                                   weights_offload=weights_offload, share_prefill=share_prefill,
                                   row_cache_bytes=row_cache, correct=correct, read_in_place=read_in_place)
    run = _prepare(settings, policies, tiers, model=model, synthetic=synthetic, layers=layers, fixed_ratio=fixed_ratio,
                   text=text, device=device, dtype=dtype, weights=weights, hf=hf, threads=threads, compile=compile,
                   pool_bytes=pool_bytes)
    from rich.console import Console
    err = Console(stderr=True)
    rows = bench.sweep(run.net, _systems(run.policies, tiers, ideal, hf, device), settings, tokenizer=run.tokenizer,
                       text=run.text, hf_model=run.hf_model, progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    if not rows:
        raise UserError("no system ran")
    recorded = dict(kv_offload=tiers, policies=names, knobs=knob, text=None if synthetic else text)
    _report(run, rows, settings, recorded, synthetic=synthetic, fixed_ratio=fixed_ratio, device=device,
            weights=weights, json_out=json_out, plot_out=plot_out)


class _Prepared(NamedTuple):
    """What a sweep runs on: the model (and transformers' twin), its tokenizer and prompt text (None for random
    weights), the policies made ready for it and the dtype "auto" resolved to."""
    net: object
    tokenizer: object
    hf_model: object
    name: str
    text: str | None
    policies: dict
    dtype: str


def _prepare(settings, policies: dict, tiers: list[str], *, model, synthetic, layers, fixed_ratio, text, device,
             dtype, weights, hf: bool, threads, compile, pool_bytes) -> _Prepared:
    """Loads the model, checks what needs its config (pools, policies, the KV's size), readies the policies
    (InfiniGen: skew from the cache, else calibrated once and cached) and compiles the step where asked."""
    import torch

    from .. import membound
    from .options import resolve_dtype
    if threads:
        torch.set_num_threads(threads)
    dtype = resolve_dtype(dtype, device)  # "auto": what this machine computes fastest in
    longest, batch = max(settings.prompt_lens), max(settings.batch_sizes)
    max_len = longest + settings.gen_len + settings.breakdown_steps + settings.count_ops
    net, tok, hf_model, name, body = _models(model, synthetic, layers, text, dtype, device, weights, hf, max_len)
    _check_pools(net, policies, tiers, batch, longest, max_len, settings.pool_bytes, pool_bytes, settings.capacity,
                 settings.row_cache_bytes)
    check_policies_fit(policies, net)
    check_kv_fits(net, batch, max_len, device)
    # auto: not under a memory bound, which is there to bound the KV tier's page cache: Inductor's compile
    # workers would be charged to it (and a 512 MiB bound cannot hold them). Compiled before the policies prepare:
    # InfiniGen's crossing (`dense_below`) is measured with the step the run decodes with
    compiled_note = enable_compile(net, compile, long_running=membound.current() is None, rows=settings.batch_sizes)
    if synthetic:
        policies = {label: pol.for_random_weights(net, fixed_ratio) for label, pol in policies.items()}
    else:
        prepare_policies(policies, net, tok, longest=max_len, batch=batch)
    if compiled_note:
        print(compiled_note, file=sys.stderr)
    return _Prepared(net, tok, hf_model, name, body, policies, dtype)

def _report(run: _Prepared, rows: list[dict], settings, recorded: dict, *, synthetic, fixed_ratio, device: str,
            weights: str, json_out: Path | None, plot_out: Path | None) -> None:
    """The rows as tables on the terminal, and as JSON and a plot where asked."""
    from .. import bench
    label = run.name + (f", InfiniGen fixed selection ratio {fixed_ratio}" if synthetic and fixed_ratio else "")
    payload = _payload(run.net, label, synthetic, device, run.dtype, weights, settings, recorded, rows)
    _print(payload)
    if json_out is not None:
        write_json(json_out, payload)
    if plot_out is not None:
        dev = payload["machine"].get("gpu") if device.startswith("cuda") else payload["machine"]["cpu"]
        bench.plot(rows, plot_out, title=f"{label} | {dev}")

def _check_sweep(prompt_len: str, batch_size: str, gen_len: int, capacity: int | None, kv_offload: str,
                 policy: str) -> tuple[list[int], list[int], list[str], list[str]]:
    """The sweep's lengths, batch sizes, tiers and policy names, each checked."""
    from ..placement import KINDS
    from ..policies import REGISTRY
    prompt_lens = _int_list("prompt-len", prompt_len)
    batch_sizes = _int_list("batch-size", batch_size)
    check_range("batch-size", max(batch_sizes), hi=MAX_ROWS)
    check_range("gen-len", gen_len, lo=2)
    check_range("capacity", capacity, lo=1)
    if capacity is not None and capacity < max(prompt_lens):
        raise UserError(f"--capacity {capacity} cannot hold the {max(prompt_lens)}-token prompt (--prompt-len); "
                        "the pool must hold at least the prompt")
    tiers = [s.strip() for s in kv_offload.split(",") if s.strip()]
    for t in tiers:
        if t not in KINDS:
            raise UserError(f"--kv-offload must be among {', '.join(KINDS)}, got {t!r}")
    if not tiers:
        raise UserError("--kv-offload: no tier given")
    names = [s.strip() for s in policy.split(",") if s.strip()]
    for n in names:
        if n.split("@")[0] not in REGISTRY:
            raise UserError(f"unknown policy {n!r}; choose from {', '.join(REGISTRY)}")
    return prompt_lens, batch_sizes, tiers, names


def _check_options(synthetic, layers, fixed_ratio, breakdown, threads, weights_offload, device, dtype, weights,
                   compile, eviction, read_in_place, tiers) -> bool:
    """The options that name no sweep, each checked before anything is loaded (`--read-in-place` reads the sweep's
    cpu tier, where it has one); returns the placement's `read_in_place`."""
    from .. import bench
    in_place = check_read_in_place(read_in_place, "cpu" if "cpu" in tiers else ",".join(tiers), device)
    check_range("breakdown", breakdown, lo=0)
    check_range("threads", threads, lo=1)
    check_range("layers", layers, lo=1)
    check_range("fixed-ratio", fixed_ratio, lo=0, hi=1, lo_open=True)
    check_range("weights-offload", weights_offload, lo=0, hi=1)
    check_model_options(device, dtype)
    check_weights_option(weights)
    check_compile_option(compile)
    if eviction not in ("counter", "lru", "fifo"):
        raise UserError(f"unknown --eviction {eviction!r}; choose counter, lru or fifo")
    if synthetic is None and (layers is not None or fixed_ratio is not None):
        raise UserError("--layers and --fixed-ratio apply to --synthetic runs")
    if synthetic is not None and synthetic not in bench.SYNTHETIC:
        raise UserError(f"unknown --synthetic shape {synthetic!r}; choose from {', '.join(bench.SYNTHETIC)}")
    return in_place


def _models(model, synthetic, layers, text, dtype: str, device, weights, hf: bool, max_len: int):
    """(our model, tokenizer, transformers' model or None, name, prompt text): random weights of a paper
    shape, or the model and text given."""
    from .. import bench
    from ..loading import DTYPES
    if synthetic:
        net, hf_model, name = bench.synthetic_models(synthetic, DTYPES[dtype], device, max_len, layers, hf=hf)
        return net, None, hf_model, name, None
    from ..paths import load_text
    from .basic import load_model
    body = load_text(text)
    net, tok, name = load_model(model, dtype, device, weights)
    if max_len > net.cfg.max_position:
        raise UserError(f"prompt + generated tokens ({max_len}) exceed the model's context ({net.cfg.max_position})")
    hf_model = bench.hf_model_for(model, DTYPES[dtype], device) if hf else None
    return net, tok, hf_model, name, body


def _check_pools(net, policies: dict, tiers: list[str], batch: int, prompt: int, max_len: int, limit, pool_bytes,
                 capacity, row_cache: int) -> None:
    """A pool of --pool-bytes must hold the longest prompt, and the row cache a row of the largest session, on
    every tier and batch (known once the model's config is: checked before compiling or running anything)."""
    if limit is not None:
        from ..placement import kv_slot_bytes
        for tier in tiers:
            for pol in policies.values():
                per = kv_slot_bytes(net, batch, pol, tier)
                if limit // per < prompt:
                    raise UserError(f"--pool-bytes {pool_bytes} holds {limit // per} tokens at batch {batch} "
                                    f"({per} bytes each, {tier}), fewer than the prompt ({prompt} tokens)")
    if row_cache:
        from ..placement import Placement
        for tier in tiers:
            if tier != "none":
                placement = Placement(kv_offload=tier, capacity=capacity, pool_bytes=limit, row_cache_bytes=row_cache)
                for pol in policies.values():
                    placement.check_row_cache(net, batch, max_len, pol)


def _systems(policies: dict, tiers: list[str], ideal: bool, hf: bool, device: str) -> list:
    """Every policy on every tier ("full" on a slow tier: FlexGen-style full offload), "ideal" (the full cache
    in fast memory) and transformers' DynamicCache."""
    from .. import bench
    from ..policies import make_policy
    systems = []
    if ideal:
        systems.append(bench.System("ideal", make_policy("full"), "none"))
    for tier in tiers:
        for label, pol in policies.items():
            if pol.exact:  # the full cache: "ideal" in fast memory, FlexGen-style full offload elsewhere
                if tier == "none":
                    if not ideal:
                        systems.append(bench.System("ideal", pol, "none"))
                    continue
                systems.append(bench.System(f"full offload ({tier})", pol, tier))
            else:
                where = "fast memory" if tier == "none" else tier
                systems.append(bench.System(f"{label} ({where})", pol, tier))
    if hf:
        systems.append(bench.System("transformers DynamicCache", hf_offloading=False))
        if device.startswith("cuda"):
            systems.append(bench.System("transformers DynamicCache(offloading)", hf_offloading=True))
    return systems


def _payload(net, label: str, synthetic, device: str, dtype: str, weights: str, s, recorded: dict,
             rows: list[dict]) -> dict:
    """What the JSON records: the model, the machine, the settings (`s`: the BenchSettings; `recorded`: the
    options it does not hold) and the rows."""
    from .. import bench, membound
    return {"model": label, "synthetic": bool(synthetic), "device": device, "dtype": dtype,
            "weights": getattr(getattr(net, "weights_info", None), "mode", weights),
            "compiled_step": _compiled_facts(net),
            "machine": bench.machine(),
            "settings": {"prompt_lens": s.prompt_lens, "batch_sizes": s.batch_sizes, "gen_len": s.gen_len,
                         "kv_offload": recorded["kv_offload"], "policies": recorded["policies"],
                         "knobs": recorded["knobs"], "capacity": s.capacity, "pool_bytes": s.pool_bytes,
                         "eviction": s.eviction, "prefetch": s.prefetch, "weights_offload": s.weights_offload,
                         "share_prefill": s.share_prefill, "row_cache_bytes": s.row_cache_bytes, "correct": s.correct,
                         "read_in_place": s.read_in_place,
                         "text": recorded["text"], "memory_bound": membound.current()},
            "rows": bench.strip_private(rows)}


def _kb(x) -> str:
    return "-" if x is None else f"{x / 2**10:.1f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


# Two narrow tables instead of one wide one: each fits 80 columns (a pipe, a small terminal); every
# number is in the JSON too.
SPEED_COLUMNS = [("ms/step", lambda r: _n(r["decode_ms_per_step"])), ("tok/s", lambda r: _n(r["decode_tokens_per_s"], 2)),
                 ("x ideal", lambda r: _n(r.get("x_vs_ideal"), 2)), ("x HF", lambda r: _n(r.get("x_vs_transformers"), 2)),
                 ("x offl.", lambda r: _n(r.get("x_vs_full_offload"), 2))]
MEMORY_COLUMNS = [("prefill s", lambda r: _n(r["prefill_s"], 2)),
                  ("KB/tok", lambda r: _n(_scaled(r.get("bytes_moved_per_token"), 2**10))),
                  ("fast MB", lambda r: _n(_scaled(r.get("peak_fast_bytes"), 2**20))),
                  ("slow MB", lambda r: _n(_scaled(r.get("peak_slow_bytes"), 2**20))),
                  ("spec MB", lambda r: _n(_scaled(r.get("speculation_bytes"), 2**20))),
                 ("rel KV", lambda r: "-" if r.get("relative_kv") is None else f"{100 * r['relative_kv']:.1f}%")]


def _scaled(x, unit):
    return None if x is None else x / unit


def _n(v, digits: int = 1) -> str:
    """A short number: `digits` decimals below 100, fewer above (the JSON has them all)."""
    if v is None:
        return "-"
    return f"{v:.{digits if abs(v) < 100 else 1 if abs(v) < 1000 else 0}f}"


def tables(rows: list[dict]) -> list:
    """The rows as two rich tables (speed; memory and traffic) that fit 80 columns: numbers never
    truncate, long system names wrap."""
    from rich import box
    from rich.table import Table
    out = []
    # the prompt length only in the first table: the second has the more columns
    for title, cols, prompt in (("decoding speed", SPEED_COLUMNS, True), ("prefill, memory and traffic", MEMORY_COLUMNS, False)):
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), title_justify="left")
        t.add_column("system", overflow="fold", ratio=1, min_width=10)
        t.add_column("batch", justify="right", no_wrap=True)
        if prompt:
            t.add_column("prompt", justify="right", no_wrap=True)
        for name, _ in cols:
            t.add_column(name, justify="right", no_wrap=True)
        for r in rows:
            t.add_row(r["system"], str(r["batch"]), *([str(r["prompt_len"])] if prompt else []), *(f(r) for _, f in cols))
        out.append(t)
    return out


def _print(p: dict) -> None:
    from rich.console import Console
    c = Console()
    m = p["machine"]
    c.print(f"{p['model']} | {p['device']} ({m.get('gpu') or m['cpu']}), {p['dtype']} | torch {m['torch']}, "
            f"{m['torch_threads']} threads")
    for t in tables(p["rows"]):
        c.print(t)
    mb = p["settings"].get("memory_bound")
    c.print(f"memory bound: {mb['describe']}" if mb else "no memory bound: a disk pool may sit in the page cache")
    for r in p["rows"]:
        mem = r.get("speculation_memory")
        if mem:
            kv = mem["speculation_vs_kv"]
            c.print(f"{r['system']} (prompt {r['prompt_len']}, batch {r['batch']}): speculation state "
                    f"{_mb(mem['speculation_bytes'])} MB = {100 * (kv or 0):.1f}% of the KV cache of the layers it covers "
                    f"(int4 layout {mem['int4_layout']}); skew matrices {100 * mem['skew_vs_weights']:.2f}% of the weights")
        if r.get("row_cache_hit_rate_per_step"):
            rates = " ".join("-" if h is None else f"{100 * h:.0f}" for h in r["row_cache_hit_rate_per_step"])
            c.print(f"{r['system']} (prompt {r['prompt_len']}, batch {r['batch']}): row cache "
                    f"{_mb(r['row_cache_bytes'])} MB, hit rate {100 * (r['row_cache_hit_rate'] or 0):.1f}%; "
                    f"per step (%): {rates}")
        if r.get("rows_read_per_step") is not None:  # what attention read from the store, beside what it attended
            c.print(f"{r['system']} (prompt {r['prompt_len']}, batch {r['batch']}): per step, "
                    f"{r['entries_attended_per_step']:.0f} entries attended, {r['rows_read_per_step']:.0f} rows of "
                    f"keys (and as many of values) read")
        if r.get("aten_calls_per_step") is not None:
            c.print(f"{r['system']} (prompt {r['prompt_len']}, batch {r['batch']}): {r['aten_calls_per_step']} aten "
                    f"calls per decoding step ({r['aten_calls_top_per_step']} top-level)")
        bd = r.get("breakdown")
        if bd:
            blk = bd["per_block_ms"]
            parts = ", ".join(f"{k} {v:.2f}" for k, v in blk.items())
            c.print(f"{r['system']} (prompt {r['prompt_len']}, batch {r['batch']}) per-block ms: {parts}; "
                    f"step {bd['step_ms']:.1f} ms; worker gather {bd['worker_gather_ms_per_step']:.1f} ms/step (overlapped)")


def _compiled_facts(net) -> dict | None:
    """What the JSON records of the compiled step: None when decoding ran eagerly."""
    parts = getattr(net, "step_parts", None)
    if parts is None:
        return None
    return {"parts": parts.compiled, "compile_s": round(parts.compile_seconds, 2), "failed": parts.failed}


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)
