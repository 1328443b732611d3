"""`infinigen ppl`: perplexity of a text with one KV-cache policy (teacher-forced), per 256-token
decoding chunk, with the relative KV size over all layers and over the speculated layers.

Policy settings have their own options; each applies only to the policies that have it (--alpha:
infinigen and oracle; --ratio: h2o, streaming, oracle; ...) and giving one to a policy without it is an
error. Anything else goes through `--knob NAME=VALUE`. Every option is checked before the model loads.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from . import placement_opts
from .basic import MODEL_HELP, check_model_options, check_range, load_model, make_policy_from_cli


def _policy_knobs(policy: str, opts: dict) -> dict:
    """CLI options -> the policy's dataclass fields (an error for an option the policy does not have)."""
    from ..policies import policy_class
    fields = {f.name for f in dataclasses.fields(policy_class(policy))}
    out = {}

    def put(option, field, value):
        if field not in fields:
            raise UserError(f"{option} does not apply to policy {policy!r}")
        out[field] = value

    for option, value in opts.items():
        if value is None or value is False:
            continue
        if option == "--no-skew":
            put(option, "skew", False)
        elif option == "--ratio" and policy == "h2o":  # half heavy hitters, half recent (H2O's split)
            put(option, "heavy_ratio", value / 2)
            put(option, "recent_ratio", value / 2)
        elif option in ("--heavy", "--recent"):  # a fraction of the length below 1, else tokens
            name = option[2:]
            if value < 1:
                put(option, f"{name}_ratio", float(value))
            elif value != int(value):
                raise UserError(f"{option} above 1 is a token count and must be an integer, got {value}")
            else:
                put(option, name, int(value))
        else:
            field = {"--alpha": "alpha", "--partial-ratio": "partial_ratio", "--max-fetch": "max_fetch_ratio",
                     "--dense-layers": "dense_layers", "--budget": "budget", "--spec-input": "spec_input",
                     "--key-mode": "key_mode", "--preset": "preset", "--sinks": "sinks", "--window": "window",
                     "--ratio": "ratio", "--tokens": "tokens", "--bits": "bits", "--group": "group",
                     "--calib": "calib"}[option]
            put(option, field, value)
    return out


def ppl_cmd(
    policy: str = typer.Option("full", "--policy", help="full, infinigen, h2o, int4, streaming or oracle."),
    text: str = typer.Option("prideprejudice", "--text",
                             help="A text file, or a bundled corpus name (prideprejudice, emma, mansfieldpark, "
                                  "northangerabbey, sensesensibility; looked up in $INFINIGEN_DATA and ../shared/data/austen)."),
    ctx: int = typer.Option(2048, "--ctx", help="Tokens per window."),
    prefill: int = typer.Option(256, "--prefill", help="Prompt tokens per window (dense); the rest is decoded and scored."),
    windows: int = typer.Option(1, "--windows", help="Non-overlapping windows from the start of the text, pooled."),
    chunk: int = typer.Option(256, "--chunk", help="Decoding-chunk size of the per-chunk table (the paper's Figure 12: 256)."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="infinigen/oracle: select tokens scoring above max - alpha."),
    partial_ratio: Optional[float] = typer.Option(None, "--partial-ratio", help="infinigen: share of head_dim columns in the partial weights."),
    max_fetch: Optional[float] = typer.Option(None, "--max-fetch", help="infinigen: at most this share of the cached tokens per step."),
    dense_layers: Optional[str] = typer.Option(None, "--dense-layers", help="infinigen: layers attending densely, e.g. '0,1' ('' = none but layer 0)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="infinigen: token count per head: mean (paper), per_head, union or layer."),
    spec_input: Optional[str] = typer.Option(None, "--spec-input", help="infinigen: attn_in (paper) or attn_out."),
    key_mode: Optional[str] = typer.Option(None, "--key-mode", help="infinigen: partial (paper) or int4."),
    preset: Optional[str] = typer.Option(None, "--preset", help="infinigen: 'default' (best measured) or 'paper'."),
    no_skew: bool = typer.Option(False, "--no-skew", help="infinigen: do not skew queries and keys."),
    calib: Optional[str] = typer.Option(None, "--calib", help="infinigen: calibration text for the skew matrices (default emma)."),
    kv_offload: str = placement_opts.KV_OFFLOAD,
    pool_bytes: Optional[str] = placement_opts.POOL_BYTES,
    capacity: Optional[float] = placement_opts.CAPACITY,
    pool_dir: Optional[Path] = placement_opts.POOL_DIR,
    eviction: str = placement_opts.EVICT,
    protect_recent: Optional[int] = typer.Option(None, "--protect-recent", help="Pool: never evict the newest N tokens."),
    heavy: Optional[float] = typer.Option(None, "--heavy", help="h2o: heavy hitters, tokens (>= 1) or a fraction of the length."),
    recent: Optional[float] = typer.Option(None, "--recent", help="h2o: recent tokens, tokens (>= 1) or a fraction of the length."),
    sinks: Optional[int] = typer.Option(None, "--sinks", help="streaming: attention-sink tokens."),
    window: Optional[int] = typer.Option(None, "--window", help="streaming: recent-window tokens."),
    ratio: Optional[float] = typer.Option(None, "--ratio", help="h2o/streaming/oracle: keep this fraction of the past tokens."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="oracle: keep this many tokens."),
    bits: Optional[int] = typer.Option(None, "--bits", help="int4: bits per value (>= 16: no quantization)."),
    group: Optional[int] = typer.Option(None, "--group", help="int4: values per quantization group."),
    knob: list[str] = typer.Option([], "--knob", help="Any other policy field NAME=VALUE (repeatable)."),
    model: str = typer.Option("default", "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the result to this JSON file ('-': stdout only)."),
):
    """Perplexity with a KV-cache policy: overall, per 256-token decoding chunk, and the relative KV size."""
    from ..eval.ppl import load_text, perplexity, resolve_text
    from ..policies import REGISTRY

    if policy not in REGISTRY:
        raise UserError(f"unknown policy {policy!r}; choose from {', '.join(REGISTRY)}")
    check_range("ctx", ctx, lo=2)
    check_range("prefill", prefill, lo=1)
    if prefill >= ctx:
        raise UserError(f"--prefill ({prefill}) must be smaller than --ctx ({ctx})")
    check_range("windows", windows, lo=1)
    check_range("alpha", alpha, lo=0, lo_open=True)
    check_range("partial-ratio", partial_ratio, lo=0, hi=1, lo_open=True)
    check_range("max-fetch", max_fetch, lo=0, hi=1, lo_open=True)
    check_range("heavy", heavy, lo=0)
    check_range("recent", recent, lo=0)
    check_range("sinks", sinks, lo=0)
    check_range("window", window, lo=0)
    check_range("ratio", ratio, lo=0, hi=1)
    check_range("tokens", tokens, lo=0)
    check_range("group", group, lo=1)
    check_range("protect-recent", protect_recent, lo=0)
    check_model_options(device, dtype)
    placement = placement_opts.placement_from(kv_offload, pool_bytes, capacity, pool_dir, eviction,
                                              protect_recent=protect_recent or 0)
    check_range("chunk", chunk, lo=1)
    if (protect_recent is not None or placement.evict != "counter") and not placement.limited:
        raise UserError("--eviction and --protect-recent need a pool limit (--capacity or --pool-bytes)")
    if calib is not None and (policy != "infinigen" or no_skew):
        raise UserError("--calib applies to policy infinigen with skewing")
    opts = {"--alpha": alpha, "--partial-ratio": partial_ratio, "--max-fetch": max_fetch,
            "--dense-layers": dense_layers, "--budget": budget, "--spec-input": spec_input, "--key-mode": key_mode,
            "--preset": preset, "--no-skew": no_skew, "--heavy": heavy, "--recent": recent, "--sinks": sinks,
            "--window": window, "--ratio": ratio, "--tokens": tokens, "--bits": bits, "--group": group, "--calib": calib}
    pol = make_policy_from_cli(policy, knob, base=_policy_knobs(policy, opts))
    path = resolve_text(text)
    body = load_text(path)
    if placement.pool_bytes is None and placement.pool_tokens(None, 1, ctx) < prefill:  # checked before loading
        raise UserError(f"a KV pool of {placement.pool_tokens(None, 1, ctx)} tokens cannot hold the {prefill}-token prompt")

    net, tok, model_name = load_model(model, dtype, device)
    pol.prepare(net, tok, progress=True)  # InfiniGen: skew from the cache, else calibrated once and cached
    from ..eval.ppl import token_windows
    ids = token_windows(tok, body, ctx, windows)
    res = perplexity(net, tok, None, pol, prefill=prefill, placement=placement, progress=True, tokens=ids, chunk=chunk)
    out = {"model": model_name, "text": str(path), "policy": policy, "settings": pol.settings(net), **res.to_dict()}
    if json_out is not None and str(json_out) == "-":
        print(json.dumps(out, indent=2))
        return
    _print(out)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {json_out}: {e}")


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


def register(app: typer.Typer) -> None:
    app.command("ppl")(ppl_cmd)
