"""What every command shares: option types, the one `--knob` parser, output-path checks and atomic
writes, and the checks that need the loaded model (run after loading, before the work).

Float options use `FLOAT` (a parser that refuses NaN and inf); a knob's value is typed by the policy's
dataclass field, so `--knob alpha=abc` and `--knob window=nan` are refused with one clear line.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from ..errors import UserError
from ..paths import write_atomic

DEVICES = ("cpu", "cuda")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_NAMES = ("auto", "int4", "int8", "bf16", "fp32", "bfloat16", "float32", "float16", "fp16")
MODEL_HELP = "'default' (SmolLM2-135M-Instruct, Q4_1), a .gguf file, or a Hugging Face checkpoint directory"
MAX_ROWS = 1 << 16  # sequences in one batch: far above what any memory holds, checked before building them


# ---- option types ------------------------------------------------------------------------------------
def finite_float(text) -> float:
    """A float option's parser: a number, and neither NaN nor infinite."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise typer.BadParameter(f"expected a number, got {text!r}")
    if not math.isfinite(value):
        raise typer.BadParameter(f"expected a finite number, got {text!r}")
    return value


FLOAT = {"parser": finite_float}  # typer.Option(..., **FLOAT)


def model_option():
    return typer.Option("default", "--model", "-m", help=MODEL_HELP)


def device_option():
    return typer.Option("cpu", "--device", help="cpu or cuda.")


def dtype_option():
    return typer.Option("auto", "--dtype", help="auto (bfloat16 where the CPU has AVX512-BF16 or AMX, and on "
                                                "CUDA; else float32), float32, bfloat16 or float16.")


def weights_option():
    return typer.Option("auto", "--weights",
                        help="auto (as a GGUF stores them: Q4_0/Q4_1 as int4, Q8_0 as int8, when computing in "
                             "bfloat16; else dense), int4 (group 32), int8 (per row), bf16 or fp32 (dense).")


def compile_option(default_help: str):
    return typer.Option("auto", "--compile", help="Compile the decoding step with torch.compile (Inductor): on (a "
                                                  "step that reads its cache densely runs whole, each layer's "
                                                  "attention inside the compiled region; whole is the same), parts "
                                                  f"(the dense work between eager attentions only), off, or auto "
                                                  f"({default_help}).")


def check_compile_option(mode: str) -> None:
    from ..compiled import MODES
    if mode not in MODES:
        raise UserError(f"unknown --compile {mode!r}; choose from {', '.join(MODES)}")


def enable_compile(net, mode: str, long_running: bool, rows=(1,), progress=None) -> str:
    """Compile `net`'s decoding step as `mode` says (`infinigen.compiled.enable`) and warm it for batches of
    `rows` rows (`progress(i, rows)` hears each before it compiles); a few words for the summary line ("" when
    it stays eager)."""
    from ..compiled import enable
    parts = enable(net, mode, long_running=long_running)
    if parts is None:
        return ""
    for i, r in enumerate(rows):
        if progress is not None:
            progress(i, r)
        parts.warm(net, r)
    return f"compiled step ({parts.compile_seconds:.1f} s to compile)" if parts.failed is None else ""


def check_weights_option(weights: str) -> None:
    if weights.lower() not in WEIGHT_NAMES:
        raise UserError(f"unknown --weights {weights!r}; choose from auto, int4, int8, bf16, fp32")


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype name "auto" stands for on `device` (other names as they are)."""
    if dtype != "auto":
        return dtype
    from ..loading import auto_dtype
    return auto_dtype("cuda" if device.startswith("cuda") else "cpu")


def knob_option(help: str = "A policy setting NAME=VALUE (repeatable), or POLICY.NAME=VALUE; e.g. --knob alpha=5."):
    return typer.Option([], "--knob", help=help)


def check_range(name: str, value, lo=None, hi=None, lo_open: bool = False) -> None:
    """UserError unless lo <= value <= hi (lo < value when lo_open) and value is finite; None is unchecked."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"--{name} must be a finite number (got {value})")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise UserError(f"--{name} must be {'>' if lo_open else '>='} {lo} (got {value})")
    if hi is not None and value > hi:
        raise UserError(f"--{name} must be <= {hi} (got {value})")


def check_model_options(device: str, dtype: str) -> None:
    if device not in DEVICES and not device.startswith("cuda:"):
        raise UserError(f"unknown device {device!r}; choose from {', '.join(DEVICES)}")
    if dtype not in DTYPE_NAMES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_NAMES)}")


# ---- knobs ---------------------------------------------------------------------------------------------
# the one knob parser lives beside the policies (`infinigen.policies.knobs`); imported on use, so that
# the CLI starts without importing torch
def knob_types(name: str) -> dict[str, Any]:
    from ..policies.knobs import knob_types
    return knob_types(name)


def parse_value(text: str, tp) -> Any:
    from ..policies.knobs import parse_value
    return parse_value(text, tp)


def knob_dict(name: str, knobs: list[str] | None, base: dict | None = None) -> dict:
    from ..policies.knobs import knob_dict
    return knob_dict(name, knobs, base)


def make_policy_from_cli(name: str, knobs: list[str] | None = None, base: dict | None = None):
    from ..policies.knobs import make_policy_from_cli
    return make_policy_from_cli(name, knobs, base)


def parse_policies(spec: str | list[str], knobs: list[str] | None = None) -> dict:
    from ..policies.knobs import parse_policies
    return parse_policies(spec, knobs)


# ---- outputs -------------------------------------------------------------------------------------------
def _probe_dir(folder: Path, option: str, target: Path) -> None:
    """The nearest existing folder at or above `folder` takes new files (checked by making one)."""
    d = folder
    while not d.exists() and d != d.parent:
        d = d.parent
    if not d.is_dir():
        raise UserError(f"cannot write {option} {target}: {d} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".infinigen-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"cannot write {option} {target}: {e.strerror or e}")


def check_out_file(path: Path | None, option: str = "--json", suffixes: tuple[str, ...] | None = None) -> None:
    """Before the work: `path` can be written (its folder exists or can be made and takes files; it is
    not a folder), with one of `suffixes` when given. "-" (stdout) passes."""
    if path is None or str(path) == "-":
        return
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder; give a file name")
    if suffixes is not None and path.suffix.lower().lstrip(".") not in suffixes:
        raise UserError(f"{option} {path}: unsupported format {path.suffix or '(none)'!r}; use one of "
                        + ", ".join("." + s for s in suffixes))
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"cannot write {option} {path}: permission denied")
    _probe_dir(path.parent, option, path)


def check_out_dir(path: Path | None, option: str = "--out") -> None:
    """Before the work: `path` is a folder we can write in, or can be made."""
    if path is None:
        return
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path} exists and is not a folder")
    _probe_dir(path, option, path)


def plot_formats() -> tuple[str, ...]:
    """File suffixes matplotlib can write."""
    from matplotlib.backend_bases import FigureCanvasBase
    return tuple(sorted(FigureCanvasBase.get_supported_filetypes()))


PARTIAL_FOLDER = ".infinigen-partial-"  # + pid: a folder being written by `atomic_folder`


@contextmanager
def atomic_folder(folder: Path, last: tuple[str, ...] = ()):
    """Write a folder's files all together or not at all: yields a fresh folder beside `folder` to write
    into; when the block ends normally its files go into place (the whole folder renamed, when `folder`
    does not exist yet; else file by file, each replaced atomically, the names in `last` after the others,
    e.g. the report that refers to the figures). On an error or Ctrl-C nothing moves and the temporary
    folder is removed; one left by a killed run (its pid in the name) is removed by the next."""
    from ..paths import remove_dead_owners
    folder = Path(folder).expanduser()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_owners(folder.parent, PARTIAL_FOLDER)
        tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_FOLDER}{os.getpid()}-{folder.name}-", dir=folder.parent))
    except OSError as e:
        raise UserError(f"cannot write {folder}: {e.strerror or e}")
    try:
        yield tmp
        try:
            if not folder.exists():
                os.rename(tmp, folder)
                return
            if not folder.is_dir():
                raise UserError(f"cannot write {folder}: it is not a folder")
            names = sorted(p.name for p in tmp.iterdir())
            for name in [n for n in names if n not in last] + [n for n in last if n in names]:
                os.replace(tmp / name, folder / name)
        except OSError as e:
            raise UserError(f"cannot write {folder}: {e.strerror or e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def finite_json(obj):
    """`obj` with NaN and inf replaced by None: they are not JSON (a layer-less mean, say, is null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def json_text(obj) -> str:
    import json
    return json.dumps(finite_json(obj), indent=2, allow_nan=False) + "\n"


def write_json(path: Path, obj) -> None:
    """`obj` as JSON, atomically."""
    write_atomic(path, json_text(obj))


# ---- checks that need the loaded model -------------------------------------------------------------------
def check_policies_fit(policies, model) -> None:
    """Layer indices in the policies' settings exist in the model (`--knob dense_layers=99`)."""
    n = model.cfg.num_layers
    for label, pol in (policies.items() if isinstance(policies, dict) else [(getattr(policies, "name", "?"), policies)]):
        layers = getattr(pol, "dense_layers", None)
        if isinstance(layers, (tuple, list, set, frozenset)):
            bad = sorted(i for i in layers if isinstance(i, int) and i >= n)
            if bad:
                raise UserError(f"policy {label!r}: dense layer {bad[0]} does not exist; the model has {n} layers (0-{n - 1})")


def check_context(model, tokens: int, what: str) -> None:
    """`tokens` positions fit the model (learned positions end there; RoPE models were not trained past it)."""
    limit = model.cfg.max_position
    if tokens > limit:
        raise UserError(f"{what} ({tokens} tokens) exceeds the model's context of {limit} positions")


def memory_bytes(device: str) -> int | None:
    """Memory of the device the KV cache lives on (`infinigen.memory.device_memory_bytes`)."""
    from ..memory import device_memory_bytes  # (torch: imported on first use, the CLI starts fast)
    return device_memory_bytes(device)


def check_kv_fits(model, rows: int, tokens: int, device: str, what: str = "--batch-size") -> None:
    """The dense KV cache of `rows` sequences of `tokens` tokens fits the device's memory at all."""
    import torch
    per_token = model.cfg.kv_bytes_per_token(torch.finfo(model.dtype).bits // 8)
    need, have = rows * tokens * per_token, memory_bytes(device)
    if have and need > have:
        raise UserError(f"{what}: {rows} sequences x {tokens} tokens need {need / 2**30:.1f} GiB of KV cache; "
                        f"the {str(device).split(':')[0]} has {have / 2**30:.1f} GiB")


# ---- policies and the model ----------------------------------------------------------------------------
def policy_settings(pol, model=None) -> dict:
    """The policy's effective knob values (for JSON outputs; with the model, also what depends on it)."""
    return pol.settings(model)


def prepare_policies(policies: dict, model, tokenizer, progress: bool = True, longest: int | None = None,
                     batch: int = 1) -> dict:
    """Model-wide setup of each policy before use (`Policy.prepare`; InfiniGen: its skew matrices, from
    the cache, else calibrated once on its `calib` text and cached; where selection pays at `batch` rows of at
    most `longest` tokens): each entry of `policies` replaced by the prepared policy, and `policies` returned."""
    for name, pol in policies.items():
        policies[name] = pol.prepare(model, tokenizer, progress=progress, longest=longest, batch=batch)
    return policies
