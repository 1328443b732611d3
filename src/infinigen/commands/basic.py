"""`infinigen generate` and `infinigen info`.

Every option is checked before the model is loaded, so a typo costs no loading time. Generated text of
the first row streams to stdout; progress and the speed summary go to stderr, so stdout can be piped.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from ..policies import REGISTRY
from .options import (FLOAT, MAX_ROWS, MODEL_HELP, check_kv_fits, check_model_options,  # noqa: F401 (re-exported)
                      check_compile_option, check_policies_fit, check_range, check_weights_option, compile_option,
                      device_option, dtype_option, enable_compile, knob_option, make_policy_from_cli, model_option,
                      resolve_dtype, weights_option, write_json)
from . import placement_opts


# ---- helpers shared with other commands ------------------------------------------------------------
@contextmanager
def spinner(message: str):
    """A rich spinner on stderr while `message`'s work runs (silent when stderr is not a terminal)."""
    from rich.console import Console
    console = Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    with console.status(message, spinner="dots"):
        yield


def load_model(model: str, dtype: str = "auto", device: str = "cpu", weights: str = "auto"):
    """(model, tokenizer, name), with a spinner while loading; a weight the quantized kernels cannot
    take is named on stderr (it runs in int8 or dense instead)."""
    from ..loading import load
    label = "the default model" if model in ("", "default") else model
    dtype = resolve_dtype(dtype, device)
    from ..membound import BOUND_ENV
    if device == "cpu" and BOUND_ENV not in os.environ:  # a first run's kernels compile while the model loads
        # (under a memory bound the command that set it built them before, and loading them beside the model's
        # own load could pass the bound)
        from ..kernels import build_native_in_background
        build_native_in_background()
    with spinner(f"Loading {label} ({dtype}, {device})..."):
        net, tok, name = load(model, dtype=dtype, device=device, weights=weights)
    fallbacks = net.weights_info.fallbacks
    if fallbacks:
        print(f"note: {len(fallbacks)} weights not in the asked format: " + "; ".join(
            f"{n} as {kind} ({why})" for n, kind, why in fallbacks[:3]) + ("; ..." if len(fallbacks) > 3 else ""),
            file=sys.stderr)
    return net, tok, name


def read_prompts(prompt: Optional[str], prompt_file: Optional[Path]) -> list[str]:
    if prompt is not None and prompt_file is not None:
        raise UserError("give either --prompt or --prompt-file, not both")
    if prompt is None and prompt_file is None:
        raise UserError("no prompt: give --prompt TEXT or --prompt-file FILE")
    if prompt is not None:
        if not prompt.strip():
            raise UserError("the prompt is empty")
        return [prompt]
    path = Path(prompt_file).expanduser()
    if path.is_dir():
        raise UserError(f"--prompt-file {path} is a folder; give a text file with one prompt per line")
    if not path.is_file():
        raise UserError(f"prompt file not found: {path}" if not path.exists() else f"--prompt-file {path} is not a regular file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read prompt file {path}: {e}")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"the prompt file {path} has no prompt (one prompt per non-empty line)")
    return prompts


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# ---- commands --------------------------------------------------------------------------------------
def generate_cmd(
    model: str = model_option(),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt text."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f",
                                               help="A text file with one prompt per line (a batch)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Tokens to generate per prompt."),
    batch_size: int = typer.Option(1, "--batch-size", "-b", help="Run every prompt this many times in one batch."),
    device: str = device_option(),
    dtype: str = dtype_option(),
    weights: str = weights_option(),
    chat: bool = typer.Option(False, "--chat/--no-chat", help="Wrap the prompt in the model's chat template."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", **FLOAT, help="0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top-p", **FLOAT, help="Nucleus sampling mass, in (0, 1]."),
    policy: str = typer.Option("full", "--policy", help=f"KV-cache policy: {', '.join(REGISTRY)}."),
    knob: list[str] = knob_option(),
    kv_offload: str = placement_opts.KV_OFFLOAD,
    pool_bytes: Optional[str] = placement_opts.POOL_BYTES,
    capacity: Optional[float] = placement_opts.CAPACITY,
    pool_dir: Optional[Path] = placement_opts.POOL_DIR,
    evict: str = placement_opts.EVICT,
    disk_block: int = placement_opts.DISK_BLOCK,
    correct: bool = placement_opts.CORRECT,
    read_in_place: Optional[bool] = placement_opts.READ_IN_PLACE,
    compile: str = compile_option("off for a generation: its compile time would outweigh what it saves"),
):
    """Generate text with the runtime, streaming the first prompt's answer."""
    from ..generate import Sampling, TextStreamer, generate

    check_range("max-new-tokens", max_new_tokens, lo=1)
    check_range("batch-size", batch_size, lo=1)
    check_range("temperature", temperature, lo=0)
    check_range("top-k", top_k, lo=0)
    check_range("top-p", top_p, lo=0, hi=1, lo_open=True)
    check_range("seed", seed, lo=0, hi=2 ** 63 - 1)
    check_model_options(device, dtype)
    check_weights_option(weights)
    check_compile_option(compile)
    check_range("batch-size", batch_size, hi=MAX_ROWS)
    prompts = read_prompts(prompt, prompt_file)
    check_range("batch-size", len(prompts) * batch_size, hi=MAX_ROWS)  # rows, before building them
    prompts = [p for p in prompts for _ in range(batch_size)]
    pol = make_policy_from_cli(policy, knob)
    read_in_place = placement_opts.check_read_in_place(read_in_place, kv_offload, device)
    placement = placement_opts.placement_from(kv_offload, pool_bytes, capacity, pool_dir, evict, disk_block=disk_block,
                                              correct=correct, read_in_place=read_in_place)
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    sampling.validate()

    try:
        net, tok, name = load_model(model, dtype, device, weights)
        check_policies_fit(pol, net)
        compiled_note = enable_compile(net, compile, long_running=False, rows=(len(prompts),))
        # the context and the memory the batch needs (KV, logits, activations) are checked by `generate`
        # itself, before it allocates anything: the same check as for a caller of the Python API
        streamer = TextStreamer(tok, row=0, write=_out)
        g = generate(net, tok, prompts, max_new_tokens=max_new_tokens, sampling=sampling, policy=pol,
                     chat=chat, on_token=streamer, placement=placement)
    except KeyboardInterrupt:  # Ctrl-C: end the streamed line; the CLI exits 130 without a traceback
        _out("\n")
        raise
    _out(g.texts[0][len(streamer.shown):] + "\n")  # what the streamer held back (an incomplete character)
    for i in range(1, len(prompts)):
        _out(f"--- [{i}] ---\n{g.texts[i]}\n")

    new = sum(len(t) for t in g.tokens)
    rows = len(prompts)
    parts = [f"{name}: {g.prompt_tokens} prompt tokens in {rows} row{'s' * (rows > 1)}",
             f"prefill {g.prefill_s:.3f} s ({g.prompt_tokens / g.prefill_s:.0f} tokens/s)" if g.prefill_s > 0 else "",
             f"{new} new tokens, decode {g.decode_tokens_per_s:.1f} tokens/s" if g.decode_steps else f"{new} new tokens"]
    if not pol.exact and g.stats is not None and g.decode_steps:
        parts.append(f"policy {policy}: relative KV size {100 * g.stats.overall():.1f}%")
    parts.append(compiled_note)
    print(" | ".join(p for p in parts if p), file=sys.stderr)


def info_cmd(
    model: str = model_option(),
    dtype: str = dtype_option(),
    device: str = device_option(),
    weights: str = weights_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the facts as one JSON object."),
):
    """Architecture, size and KV cache cost per token of a model."""
    import json

    check_model_options(device, dtype)
    check_weights_option(weights)
    dtype = resolve_dtype(dtype, device)
    net, tok, name = load_model(model, dtype, device, weights)
    facts = model_facts(net, name)
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    cfg = net.cfg
    mib = 1024 ** 2
    gqa = f" (GQA {cfg.group_size}:1)" if cfg.group_size > 1 else ""
    lines = [
        ("model", name),
        ("architecture", f"{facts['model_type']} ({facts['family']})"),
        ("layers", cfg.num_layers),
        ("hidden size", cfg.hidden_size),
        ("heads", f"{cfg.num_heads} query, {cfg.num_kv_heads} KV{gqa}, head_dim {cfg.head_dim}"),
        ("MLP size", f"{cfg.intermediate_size} ({cfg.activation})"),
        ("vocabulary", cfg.vocab_size),
        ("context", f"{cfg.max_position} tokens"),
        ("positions", facts["positions"]),
        ("parameters", f"{facts['parameters']:,} ({facts['parameters'] / 1e6:.1f} M)"),
        ("weights", f"{facts['weight_bytes'] / mib:.1f} MiB ({facts['weights']})"),
        ("KV cache per token", f"{facts['kv_bytes_per_token']['float16']:,} B in float16, "
                               f"{facts['kv_bytes_per_token'][dtype]:,} B in {dtype} (one sequence, all layers)"),
        ("KV cache, full context", f"{facts['kv_bytes_per_token']['float16'] * cfg.max_position / mib:.1f} MiB in float16 "
                                   f"per sequence of {cfg.max_position} tokens"),
    ]
    width = max(len(k) for k, _ in lines) + 1
    for k, v in lines:
        print(f"{k + ':':<{width}} {v}")


def model_facts(net, name: str) -> dict:
    """The numbers `info` prints, as a dict (also used by benchmarks)."""
    import torch

    from ..kernels.qlinear import parameter_count
    from ..memory import weight_bytes
    cfg = net.cfg
    params = parameter_count(net)  # tied weights are counted once; a quantized weight as its N x K entries
    if cfg.uses_rope:
        rp = getattr(cfg.hf_config, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(cfg.hf_config, "rope_theta", None))
        kind = rp.get("rope_type", "default")
        positions = f"RoPE (theta {theta:g}, {kind})" if theta else "RoPE"
        if cfg.sliding_window:
            positions += f", sliding window {cfg.sliding_window}"
    else:
        positions = "learned position embeddings"
    family = "Llama family" if cfg.arch == "llama" else ("OPT, pre-norm" if cfg.pre_norm else "OPT, post-norm")
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    loaded = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(net.dtype, str(net.dtype))
    return {
        "name": name, "model_type": cfg.model_type, "family": family, "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "context": cfg.max_position, "positions": positions, "parameters": params,
        "weight_bytes": weight_bytes(net), "dtype": loaded,
        "weights": info.summary() if (info := getattr(net, "weights_info", None)) else f"dense, {loaded}",
        "kv_bytes_per_token": {k: cfg.kv_bytes_per_token(v) for k, v in sizes.items()},
    }


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
    app.command("info")(info_cmd)
