"""`infinigen skew`: calibrate (or reuse) the model's skewing matrices and show what they do.

Prints where the artifact lives and, per layer, the share of the queries' squared norm held by the
top 30% of the columns, skewed vs unskewed (on the calibration queries): the concentration that lets
InfiniGen score tokens with a few columns.
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..errors import UserError
from .basic import load_model
from .options import FLOAT, check_model_options, device_option, dtype_option, model_option


def register(app: typer.Typer) -> None:
    app.command("skew")(skew)


def skew(
    model: str = model_option(),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration text (UTF-8): a file, or a bundled corpus name (default emma, shipped with the package)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Calibration tokens from the start of the text "
                                         "(default 4096, or all of a shorter text); the text must hold them."),
    ratio: float = typer.Option(0.3, "--ratio", **FLOAT, help="Share of the columns whose squared-norm share is reported."),
    force: bool = typer.Option(False, "--force", help="Recompute even when a cached artifact exists."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    device: str = device_option(),
    dtype: str = dtype_option(),
):
    """Compute (or reuse) the skew matrices of a model and report how much they concentrate the queries."""
    if tokens is not None and tokens < 1:
        raise UserError("--tokens must be >= 1")
    if not 0 < ratio <= 1:
        raise UserError("--ratio must be in (0, 1]")
    check_model_options(device, dtype)
    from ..skew import calibration_text, load_or_compute_skew
    calibration_text(calib)  # a missing, binary or empty text fails before the model loads
    net, tok, name = load_model(model, dtype, device)
    s = load_or_compute_skew(net, tok, calib, tokens, force=force, progress=not as_json and sys.stderr.isatty())
    skewed, plain = s.share(ratio)
    reused = s.meta.get("reused") == "1"
    if as_json:
        print(json.dumps({"model": name, "path": str(s.path), "reused": reused, "calibration": s.meta.get("calibration"),
                          "tokens": int(s.meta.get("tokens", 0)), "fingerprint": s.meta.get("fingerprint"), "ratio": ratio,
                          "share_skewed": [round(float(v), 4) for v in skewed],
                          "share_unskewed": [round(float(v), 4) for v in plain],
                          "mean_skewed": round(float(skewed.mean()), 4), "mean_unskewed": round(float(plain.mean()), 4)}))
        return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    con.print(f"{'reused' if reused else 'saved'} skew artifact: {s.path}")
    con.print(f"model {name}, calibration {s.meta.get('calibration')} ({s.meta.get('tokens')} tokens)")
    t = Table(title=f"squared-norm share of the top {ratio:.0%} query columns")
    for c in ("layer", "unskewed", "skewed"):
        t.add_column(c, justify="right")
    for i, (a, b) in enumerate(zip(plain.tolist(), skewed.tolist())):
        t.add_row(str(i), f"{a:.3f}", f"{b:.3f}")
    t.add_row("mean", f"{plain.mean():.3f}", f"{skewed.mean():.3f}", style="bold")
    con.print(t)
