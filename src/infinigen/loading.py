"""Loading models into the runtime: the default GGUF model, Hugging Face checkpoint directories,
and in-memory `transformers` models (tests build small random ones).

Formats are parsed by the libraries that own them (`transformers` for configs, tokenizers and GGUF
dequantization, `safetensors` for weights, `gguf` for a GGUF file's quantized blocks). This module is the
entry point (`load`); the work is done by `precision` (the dtype and weight mode), `checkpoints` (tensors
renamed into `Transformer`), `gguf_model` (GGUF conversion and raw blocks) and `quantized` (re-quantization).
A GGUF file is converted once and cached as a safetensors checkpoint
(config, tokenizer, the dequantized float32 weights), so later loads take a second.

Precision, two choices (`load(dtype=..., weights=...)`, `--dtype`, `--weights`):
  dtype    what the runtime computes in. "auto": bfloat16 where the hardware has it (AVX512-BF16 or AMX
           on the CPU, any CUDA GPU), float32 elsewhere.
  weights  how the projection matrices (attention q/k/v/o, MLP) and the embedding / output table are held.
           "auto": as the file stores them where a kernel runs them fast (compute in bfloat16): a GGUF's
           Q4_0/Q4_1 matrices as group-wise int4 (group 32, kernels/qlinear.py), Q8_0 as per-row int8;
           everything else dense in the compute dtype (with float32 or float16 compute, all dense: the CPU
           int4 kernel is fast only in bfloat16).
           "int4": every projection int4 (the file's Q4 blocks as they are, anything else re-quantized,
           group 32), the embedding / output table int8 (per row). "int8": projections and table int8.
           "bf16" / "fp32" (or "bfloat16" / "float32" / "float16"): dense, dequantized, in that dtype.
  A weight the int4 kernel cannot take (shape) falls back to int8, then dense; `model.weights_info` lists
  each fallback with its reason.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .checkpoints import (PROJECTIONS, build, cached_hint, checkpoint_source, file_fingerprint,  # noqa: F401
                          from_transformers, read_safetensors, runtime_name)
from .config import ModelConfig
from .errors import UserError
from .gguf_model import (DEFAULT_MODEL_NAME, _gguf_blocks, _read_gguf_blocks, convert_gguf,  # noqa: F401
                         default_gguf, gguf_modules, gguf_row_order)
from .paths import cache_dir  # noqa: F401 (re-exported)
from .precision import (DTYPE_CHOICES, DTYPES, WEIGHT_CHOICES, WEIGHTS, auto_dtype,  # noqa: F401
                        resolve_precision)
from .quantized import WeightsInfo, cast_parameters, join_projections, quantize_model, wanted_kind

_convert_gguf = convert_gguf  # the name benchmarks and tests import


def load(spec: str | os.PathLike | None = None, dtype: str | torch.dtype | None = None, device: str = "cpu",
         progress: bool = True, weights: str = "auto"):
    """(model, tokenizer, name) for `spec`: None/"default", a .gguf file, or a checkpoint directory.

    dtype: "float32", "bfloat16", "float16" or "auto" (bfloat16 where the hardware has it); None is
    float32, or the dtype that a dense `weights` names. weights: "auto", "int4", "int8", "bf16", "fp32"
    (see the module docstring). `model.weights_info` says what each weight became."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA GPU")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}; choose cpu or cuda")
    dtype, mode = resolve_precision(dtype, weights, device)
    if spec in (None, "", "default"):
        path, name = default_gguf(), DEFAULT_MODEL_NAME
    else:
        path = Path(spec).expanduser()
        name = path.name
        if not path.exists():
            raise UserError(f"model path not found: {path}")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise UserError(f"{path} has neither config.json nor a .gguf file")
        path = ggufs[0]
    gguf_file = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path}: expected a .gguf file or a checkpoint directory")
        gguf_file, path = path, convert_gguf(path, progress)
    from transformers import AutoConfig, AutoTokenizer
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path / 'config.json'}: {str(e).splitlines()[0]}{cached_hint(path)}")
    cfg = ModelConfig.from_hf(hf_cfg)
    info = WeightsInfo(dtype=str(dtype).removeprefix("torch."), mode=mode)
    native = gguf_modules(gguf_file, path, cfg, dtype, device, mode, info) if gguf_file is not None else {}
    held = {p + ".weight" for p in native}

    def skip(hf_name: str) -> bool:  # tensors the native modules hold are not read (hundreds of MB)
        new = runtime_name(hf_name, cfg)
        return new in held or (new == "lm_head.weight" and "lm_head" in native)

    # what is re-quantized here is quantized from float32 (not from weights already rounded to the
    # compute dtype); the rest is cast after. Nothing to re-quantize: built in the compute dtype directly.
    tables = ("embed_tokens", "lm_head")
    requant = mode in ("int4", "int8") or any(
        wanted_kind(mode, n in tables, t) != "dense" and n not in native for n, t in info.file_types.items())
    source = torch.float32 if requant else dtype
    model = build(cfg, read_safetensors(path, skip=skip if native else None), dtype=source, device=device,
                  modules=native)
    quantize_model(model, mode, dtype, device, info)
    cast_parameters(model, dtype)
    join_projections(model)
    model.weights_info = info
    # the file the weights came from, whatever dtype and weight mode they were made into: one calibration
    # (skew matrices and InfiniGen's settings, `skew.model_fingerprint`) serves them all
    model.source_fingerprint = (f"gguf:{file_fingerprint(gguf_file)}" if gguf_file is not None
                                else checkpoint_source(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        f"{cached_hint(path)}")
    return model, tokenizer, name
