"""`infinigen needle`: passkey and needle-in-a-haystack retrieval per policy, context x depth grid."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from . import placement_opts
from .basic import load_model
from .options import (check_model_options, check_out_dir, check_policies_fit, device_option, dtype_option,
                      knob_option, model_option, parse_policies, prepare_policies, write_atomic, write_json)


def _ints(text: str, name: str) -> list[int]:
    out = []
    for s in text.split(","):
        s = s.strip().lower()
        if not s:
            continue
        try:
            out.append(int(float(s[:-1]) * 1024) if s.endswith("k") else int(s))
        except ValueError:
            raise UserError(f"--{name}: expected comma-separated token counts such as 1024,2K,8K, got {text!r}")
    if not out or any(n < 64 for n in out):
        raise UserError(f"--{name}: give context lengths of at least 64 tokens, got {text!r}")
    return out


def _fracs(text: str) -> list[float]:
    try:
        out = [float(s.strip().rstrip("%")) / (100 if s.strip().endswith("%") else 1) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--depths: expected fractions such as 0,0.5,1 (or 0%,50%,100%), got {text!r}")
    if not out or any(not 0 <= d <= 1 for d in out):
        raise UserError(f"--depths: fractions must be in [0, 1], got {text!r}")
    return out


def needle_cmd(
    task: str = typer.Option("passkey,niah", "--task", help="passkey, niah, or both (comma-separated); 'all' = both."),
    policy: str = typer.Option("full,infinigen,h2o", "--policy", help="Comma-separated policies."),
    knob: list[str] = knob_option("NAME=VALUE for every policy that has it, or POLICY.NAME=VALUE."),
    lengths: str = typer.Option("1K,2K", "--lengths", help="Context lengths in tokens, e.g. 1K,2K,4K,8K."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths as fractions of the haystack."),
    haystack: Optional[str] = typer.Option(None, "--haystack",
                                           help="filler, pg (Paul Graham essays), austen, a novel's name, or a text file "
                                                "(default: filler for passkey, pg for niah)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Use the chat template (default: when the model has one)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the pass keys."),
    batch_tokens: int = typer.Option(8192, "--batch-tokens", help="Prompt tokens per batched prefill (memory bound)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for needle.md, needle.json and needle_heatmap.png."),
    model: str = model_option(),
    device: str = device_option(),
    dtype: str = dtype_option(),
    kv_offload: str = placement_opts.KV_OFFLOAD,
    pool_bytes: Optional[str] = placement_opts.POOL_BYTES,
    capacity: Optional[float] = placement_opts.CAPACITY,
    pool_dir: Optional[Path] = placement_opts.POOL_DIR,
    evict: str = placement_opts.EVICT,
):
    """Retrieval accuracy per policy over context lengths and needle depths; table and heat map."""
    from tqdm.auto import tqdm

    from ..eval import needle as nd

    tasks = list(nd.TASKS) if task == "all" else [t.strip() for t in task.split(",") if t.strip()]
    for t in tasks:
        if t not in nd.TASKS:
            raise UserError(f"unknown needle task {t!r}; choose from {', '.join(nd.TASKS)}")
    ls, ds = _ints(lengths, "lengths"), _fracs(depths)
    if batch_tokens < 1:
        raise UserError("--batch-tokens must be >= 1")
    check_model_options(device, dtype)
    pols = parse_policies(policy, knob)
    placement = placement_opts.placement_from(kv_offload, pool_bytes, capacity, pool_dir, evict)
    check_out_dir(out, "--out")
    if haystack not in (None, "filler", "pg"):
        nd.haystack_text(haystack)  # fail on a bad name before loading the model
    net, tok, model_name = load_model(model, dtype, device)
    if max(ls) + 32 > net.cfg.max_position:
        raise UserError(f"--lengths: {max(ls)} exceeds the model's context of {net.cfg.max_position}")
    check_policies_fit(pols, net)
    prepare_policies(pols, net, tok)
    total = len(tasks) * len(ls) * len(ds) * len(pols)
    with tqdm(total=total, desc="needle", unit="answer", file=sys.stderr) as bar:
        results = nd.evaluate(net, tok, pols, tasks, ls, ds, haystack, chat, seed, batch_tokens, progress=bar.update,
                              placement=placement)
    table = nd.markdown_tables(results)
    print(f"{model_name}: retrieval score (passkey: exact key; niah: share of key phrases)\n")
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        png = nd.heatmap(results, out / "needle_heatmap.png")
        write_atomic(out / "needle.md", f"# Needle retrieval: {model_name}\n\n{table}\n\n![heat map]({png.name})\n")
        write_json(out / "needle.json", {"model": model_name, "results": nd.to_json(results)})
        print(f"\nwrote {out / 'needle.md'}, {png}", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("needle")(needle_cmd)
