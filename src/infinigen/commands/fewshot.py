"""`infinigen fewshot`: k-shot multiple choice (BIG-bench tasks) scored by log-likelihood, per policy."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from . import placement_opts
from .basic import load_model
from .options import (FLOAT, check_model_options, check_out_file, check_policies_fit, check_range, device_option,
                      dtype_option, knob_option, model_option, parse_policies, prepare_policies, write_json)


def fewshot_cmd(
    task: str = typer.Option("all", "--task", help="A task name, a comma-separated list, or 'all'."),
    shots: int = typer.Option(5, "--shots", help="Solved examples in each prompt."),
    policy: str = typer.Option("full,infinigen", "--policy",
                               help="Comma-separated policies (the full cache is always scored, for agreement)."),
    knob: list[str] = knob_option("NAME=VALUE for every policy that has it, or POLICY.NAME=VALUE."),
    limit: Optional[int] = typer.Option(10, "--limit", help="Examples per task (0 = all)."),
    prefill_frac: float = typer.Option(1.0, "--prefill-frac", **FLOAT,
                                       help="Fraction of the prompt processed densely; the rest and the answer are decoded with the policy."),
    seed: int = typer.Option(1234, "--seed", help="Seed for the example order and the shots."),
    data: Optional[Path] = typer.Option(None, "--data", help="BIG-bench task folder (default: $INFINIGEN_DATA/bigbench, else the 13 tasks shipped with the package)."),
    model: str = model_option(),
    device: str = device_option(),
    dtype: str = dtype_option(),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results to this JSON file."),
    list_only: bool = typer.Option(False, "--list", help="List the available tasks and exit."),
    kv_offload: str = placement_opts.KV_OFFLOAD,
    pool_bytes: Optional[str] = placement_opts.POOL_BYTES,
    capacity: Optional[float] = placement_opts.CAPACITY,
    pool_dir: Optional[Path] = placement_opts.POOL_DIR,
    evict: str = placement_opts.EVICT,
):
    """Few-shot accuracy (acc, acc_norm) and agreement with the full cache, per task and policy."""
    from tqdm.auto import tqdm

    from ..eval import fewshot as fs

    root = fs.find_root(data)
    if list_only:
        for name, path in fs.list_tasks(root).items():
            n = len(json.loads(path.read_text(encoding="utf-8"))["examples"])
            print(f"{name}\t{n} examples")
        return
    check_range("shots", shots, lo=0)
    check_range("limit", limit, lo=0)
    check_range("prefill-frac", prefill_frac, lo=0, hi=1, lo_open=True)
    check_model_options(device, dtype)
    names = fs.resolve_tasks(task, root)
    pols = parse_policies(policy, knob)
    placement = placement_opts.placement_from(kv_offload, pool_bytes, capacity, pool_dir, evict)
    check_out_file(json_out, "--json")
    tasks = [fs.Task.load(n, fs.list_tasks(root)[n]) for n in names]
    for t in tasks:  # the shots are other examples of the task
        if shots > len(t.examples) - 1:
            raise UserError(f"--shots {shots}: task {t.name} has {len(t.examples)} examples, so at most "
                            f"{len(t.examples) - 1} shots")
    lim = limit or None
    total = sum(min(len(t.examples), lim or len(t.examples)) for t in tasks) * len(pols | {"full": None})
    net, tok, model_name = load_model(model, dtype, device)
    check_policies_fit(pols, net)
    prepare_policies(pols, net, tok)
    results = []
    with tqdm(total=total, desc="fewshot", unit="ex", file=sys.stderr) as bar:
        for t in tasks:
            bar.set_postfix_str(t.name)
            results += fs.evaluate_task(net, tok, t, pols, shots=shots, limit=lim, prefill_frac=prefill_frac,
                                        seed=seed, progress=bar.update, placement=placement)
    print(f"{model_name}, {shots}-shot, prefill fraction {prefill_frac:g}\n")
    print(fs.markdown_table(results))
    if len(tasks) > 1:
        print()
        print(fs.markdown_table(fs.summarize(results)))
    if json_out is not None:
        write_json(json_out, {"model": model_name, "shots": shots, "prefill_frac": prefill_frac,
                              "results": [r.to_dict(True) for r in results]})


def register(app: typer.Typer) -> None:
    app.command("fewshot")(fewshot_cmd)


__all__ = ["register", "fewshot_cmd", "UserError"]
