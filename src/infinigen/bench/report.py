"""The benchmark's report: ratios within each cell, the machine it ran on, JSON and plots."""
from __future__ import annotations

import json
import os
import platform

import torch

from ..machine import cpu_name as _cpu_name
from ..errors import UserError


def add_ratios(rows: list[dict]) -> None:
    """Decode-throughput ratios within each (prompt length, batch) cell: vs transformers' DynamicCache,
    vs ideal, vs full offload on the same tier; and how many generated tokens agree with ideal's."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["prompt_len"], r["batch"]), []).append(r)
    for cell in cells.values():
        ref = {}
        for r in cell:
            if r["policy"] == "transformers" and r["kv_offload"] == "none":
                ref["hf"] = r
            elif r.get("exact") and r["kv_offload"] == "none":
                ref["ideal"] = r
            elif r.get("exact"):
                ref.setdefault(("full", r["kv_offload"]), r)
        for r in cell:
            tps = r.get("decode_tokens_per_s")
            if not tps:
                continue
            for key, name in (("hf", "x_vs_transformers"), ("ideal", "x_vs_ideal")):
                if key in ref and ref[key].get("decode_tokens_per_s"):
                    r[name] = tps / ref[key]["decode_tokens_per_s"]
            full = ref.get(("full", r["kv_offload"])) or next((v for k, v in ref.items() if isinstance(k, tuple)), None)
            if full is not None and full.get("decode_tokens_per_s"):
                r["x_vs_full_offload"] = tps / full["decode_tokens_per_s"]
            if "ideal" in ref and "_tokens" in r and "_tokens" in ref["ideal"]:
                r["tokens_agree_with_ideal"] = float((r["_tokens"] == ref["ideal"]["_tokens"]).float().mean())


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def cpu_name() -> str:
    """The CPU model, for naming the machine under a result."""
    return _cpu_name()


def strip_private(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def write_json(path, payload: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e}")


def plot(rows: list[dict], path, title: str = "") -> None:
    """Decode throughput against batch size (at the longest prompt) and against prompt length (at the
    largest batch), one line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    rows = [r for r in rows if r.get("decode_tokens_per_s")]
    if not rows:
        raise UserError("nothing to plot: no run produced a decode throughput")
    systems = list(dict.fromkeys(r["system"] for r in rows))
    t_max = max(r["prompt_len"] for r in rows)
    b_max = max(r["batch"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (xkey, fixed_key, fixed, xlabel) in zip(axes, (
            ("batch", "prompt_len", t_max, "batch size"), ("prompt_len", "batch", b_max, "prompt length (tokens)"))):
        for name in systems:
            pts = sorted((r[xkey], r["decode_tokens_per_s"]) for r in rows if r["system"] == name and r[fixed_key] == fixed)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title(f"{'prompt' if fixed_key == 'prompt_len' else 'batch'} {fixed}")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e}")
    finally:
        plt.close(fig)
