"""`infinigen ppl`: perplexity of a text with one KV-cache policy (teacher-forced), per 256-token
decoding chunk, with the relative KV size over all layers and over the speculated layers.

Policy settings go through `--knob NAME=VALUE`, typed by the policy's fields (the error for an unknown
knob lists them); a knob the policy does not have is an error. Every option is
checked before the model loads; the context and layer indices right after it, before the work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from . import placement_opts
from .basic import load_model
from .options import (FLOAT, MODEL_HELP, check_context, device_option, dtype_option, model_option, check_model_options, check_out_file, check_policies_fit,
                      check_range, knob_option, make_policy_from_cli, policy_settings, prepare_policies, json_text,
                      write_json)
from .options import check_weights_option, weights_option


def ppl_cmd(
    policy: str = typer.Option("full", "--policy", help="full, infinigen, h2o, int4, streaming or oracle."),
    text: str = typer.Option("prideprejudice", "--text",
                             help="A text file, or a bundled corpus name (prideprejudice, emma, mansfieldpark, "
                                  "northangerabbey, sensesensibility: shipped with the package; $INFINIGEN_DATA is searched first)."),
    ctx: int = typer.Option(2048, "--ctx", help="Tokens per window."),
    prefill: int = typer.Option(256, "--prefill", help="Prompt tokens per window (dense); the rest is decoded and scored."),
    windows: int = typer.Option(1, "--windows", help="Non-overlapping windows from the start of the text, pooled."),
    chunk: int = typer.Option(256, "--chunk", help="Decoding-chunk size of the per-chunk table (the paper's Figure 12: 256)."),
    calib: Optional[str] = typer.Option(None, "--calib", help="infinigen: calibration text for the skew matrices (default emma)."),
    kv_offload: str = placement_opts.KV_OFFLOAD,
    pool_bytes: Optional[str] = placement_opts.POOL_BYTES,
    capacity: Optional[float] = placement_opts.CAPACITY,
    pool_dir: Optional[Path] = placement_opts.POOL_DIR,
    eviction: str = placement_opts.EVICT,
    disk_block: int = placement_opts.DISK_BLOCK,
    correct: bool = placement_opts.CORRECT,
    protect_recent: Optional[int] = typer.Option(None, "--protect-recent", help="Pool: never evict the newest N tokens."),
    knob: list[str] = knob_option("A policy setting NAME=VALUE (repeatable), e.g. --knob alpha=5, --knob heavy_ratio=0.1."),
    model: str = model_option(),
    device: str = device_option(),
    dtype: str = dtype_option(),
    weights: str = weights_option(),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the result to this JSON file ('-': stdout only)."),
):
    """Perplexity with a KV-cache policy: overall, per 256-token decoding chunk, and the relative KV size."""
    from ..eval.ppl import perplexity
    from ..paths import load_text, resolve_text
    from ..policies import REGISTRY

    if policy not in REGISTRY:
        raise UserError(f"unknown policy {policy!r}; choose from {', '.join(REGISTRY)}")
    check_range("ctx", ctx, lo=2)
    check_range("prefill", prefill, lo=1)
    if prefill >= ctx:
        raise UserError(f"--prefill ({prefill}) must be smaller than --ctx ({ctx})")
    check_range("windows", windows, lo=1)
    check_range("protect-recent", protect_recent, lo=0)
    check_model_options(device, dtype)
    check_weights_option(weights)
    placement = placement_opts.placement_from(kv_offload, pool_bytes, capacity, pool_dir, eviction,
                                              protect_recent=protect_recent or 0, disk_block=disk_block,
                                              correct=correct)
    check_range("chunk", chunk, lo=1)
    if (protect_recent is not None or placement.evict != "counter") and not placement.limited:
        raise UserError("--eviction and --protect-recent need a pool limit (--capacity or --pool-bytes)")
    pol = make_policy_from_cli(policy, knob)
    if calib is not None:
        from ..policies import knob_types
        if "calib" not in knob_types(policy):
            raise UserError(f"--calib applies to policies that calibrate on text; {policy!r} does not")
        # made again with it, not `dataclasses.replace`d: the knobs the user left to the preset or to
        # calibration (InfiniGen's `calibrate`) must stay left
        pol = make_policy_from_cli(policy, knob, base={"calib": calib})
    check_out_file(json_out, "--json")
    path = resolve_text(text)
    body = load_text(path)
    if placement.pool_bytes is None and placement.pool_tokens(None, 1, ctx) < prefill:  # checked before loading
        raise UserError(f"a KV pool of {placement.pool_tokens(None, 1, ctx)} tokens cannot hold the {prefill}-token prompt")

    net, tok, model_name = load_model(model, dtype, device, weights)
    check_context(net, ctx, "--ctx")
    check_policies_fit(pol, net)
    pol = prepare_policies({policy: pol}, net, tok)[policy]  # InfiniGen: skew from the cache, else calibrated once and cached
    from ..eval.ppl import token_windows
    ids = token_windows(tok, body, ctx, windows)
    res = perplexity(net, tok, None, pol, prefill=prefill, placement=placement, progress=True, tokens=ids, chunk=chunk)
    out = {"model": model_name, "text": str(path), "policy": policy, "settings": policy_settings(pol, net),
           **res.to_dict()}
    if json_out is not None and str(json_out) == "-":
        print(json_text(out), end="")
        return
    _print(out)
    if json_out is not None:
        write_json(json_out, out)


def _print(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console()
    pool = f", pool {r['capacity']} tokens ({r['eviction']})" if r["eviction"] else ""
    console.print(f"{r['model']} | {Path(r['text']).name} | ctx {r['ctx']}, prefill {r['prefill']}, "
                  f"{r['windows']} window(s){pool} | policy {r['policy']}")
    table = Table(title="perplexity per decoding chunk")
    table.add_column("chunk", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column("positions")
    table.add_column("perplexity", justify="right")
    for c in r["chunks"]:
        table.add_row(str(c["chunk"]), str(c["tokens"]), f"{c['start']}-{c['end'] - 1}", f"{c['perplexity']:.3f}")
    console.print(table)
    console.print(f"perplexity: {r['perplexity']:.4f} over {r['tokens']} tokens ({r['seconds']:.1f} s)")
    spec = r["speculated_layers"]
    console.print(f"relative KV size: {100 * r['kv_all']:.2f}% over all {len(r['kv_per_layer'])} layers, "
                  f"{100 * r['kv_speculated']:.2f}% over the {len(spec)} selecting layers")
    if r["local_layers"]:
        n_global = len(r["kv_per_layer"]) - len(r["local_layers"])
        console.print(f"  {100 * r['kv_global']:.2f}% over the {n_global} global layers (the "
                      f"{len(r['local_layers'])} sliding-window layers read their window, as the full cache does)")


def register(app: typer.Typer) -> None:
    app.command("ppl")(ppl_cmd)
