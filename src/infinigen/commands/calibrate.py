"""`infinigen calibrate`: make a model's InfiniGen calibration ahead of use (before `serve`, say).

The skew matrices (`infinigen.skew`) and the settings InfiniGen's `calibrate` chooses
(`infinigen.policies.calibrate`) are computed once per model file and cached: every later command on that
file, in any dtype and weight mode, reuses them. The default model's ship with the package. `--force`
computes both again; `--out` also writes the artifact (skew and choice, one safetensors file) to a file or
folder: how the package's own was made.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from .basic import load_model
from .options import (check_model_options, check_out_dir, check_out_file, check_weights_option, device_option, knob_option,
                      make_policy_from_cli, model_option)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)


def calibrate(
    model: str = model_option(),
    knob: list[str] = knob_option("An InfiniGen setting NAME=VALUE (repeatable), e.g. --knob calibrate_target=0.01; "
                                  "knobs set here are kept, the rest are chosen."),
    force: bool = typer.Option(False, "--force", help="Compute the skew and the settings again, even when cached "
                                                       "or shipped."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the artifact (skew matrices and settings, "
                                                           "safetensors) to this file, or into this folder."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    device: str = device_option(),
    dtype: str = typer.Option("float32", "--dtype", help="Compute dtype of the calibration (float32: the one "
                                                         "calibration serves every dtype, made in the most precise)."),
    weights: str = typer.Option("fp32", "--weights", help="Weight mode of the calibration (fp32: dense, as the "
                                                          "file's weights dequantized)."),
):
    """Calibrate InfiniGen on a model now (skew matrices and settings), so later commands start at once."""
    check_model_options(device, dtype)
    check_weights_option(weights)
    pol = make_policy_from_cli("infinigen", knob)
    if not pol.calibrate or not pol.skew:
        raise UserError("calibrate makes the skew and the chosen settings: do not set calibrate=false or skew=false")
    target = _out_file(out)
    from ..skew import calibration_text, load_or_compute_skew
    calibration_text(pol.calib)  # a missing, binary or empty text fails before the model loads
    from ..policies.infinigen import _SKEWS
    net, tok, name = load_model(model, dtype, device, weights)
    if force:
        _SKEWS.setdefault(net, {})[pol.calib] = load_or_compute_skew(net, tok, pol.calib, force=True, progress=True)
    # longest=0: where selection pays is not measured here: it depends on the dtype, weights and compilation a
    # command decodes with, which this search's float32 model does not share; the first command that caches
    # enough tokens measures it for its own setup (seconds), or finds it stored
    pol = pol.prepare(net, tok, progress=True, longest=0)
    skew = _SKEWS[net][pol.calib]
    record = pol.settings(net)["calibration"]
    written = None
    if target is not None:
        written = target if target.suffix and not target.is_dir() else target / skew.path.name
        _write_artifact(skew, written)
    if as_json:
        print(json.dumps({"model": name, "fingerprint": skew.meta.get("fingerprint"), "artifact": str(skew.path),
                          "out": None if written is None else str(written), "source": record["source"],
                          "calibration": record, "settings": pol.settings(net)}, default=str))
    else:
        print(f"{name}: {record['source']} calibration in {skew.path}"
              + (f"; written to {written}" if written is not None else ""))


def _out_file(out: Optional[Path]) -> Optional[Path]:
    """`--out` checked before the work: a .safetensors file that can be written, or a folder (existing, or a
    name without a suffix: made) that the artifact goes into under its own name."""
    if out is None:
        return None
    out = Path(out).expanduser()
    if out.suffix and not out.is_dir():
        check_out_file(out, "--out", ("safetensors",))
        return out
    check_out_dir(out, "--out")
    return out


def _write_artifact(skew, path: Path) -> None:
    """The artifact with its text named by where it lies in the package (not by this machine's path), and
    how it was made; written atomically (`Skew.save`)."""
    import torch

    from .. import __version__
    from ..paths import PACKAGE_DATA
    meta = {k: v for k, v in skew.meta.items() if k != "reused"}
    text = Path(str(meta.get("calibration", "")))
    if text.is_relative_to(PACKAGE_DATA):
        meta["calibration"] = f"package:{text.relative_to(PACKAGE_DATA).as_posix()}"
    meta["made_with"] = f"infinigen {__version__}, torch {torch.__version__}, {sys.platform}"
    try:
        dataclasses.replace(skew, meta=meta, path=None, shipped=False).save(path)
        path.chmod(0o644)  # package data: readable by every user of an installation
    except OSError as e:
        raise UserError(f"cannot write --out {path}: {e.strerror or e}")
