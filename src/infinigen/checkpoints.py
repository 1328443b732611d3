"""Hugging Face checkpoints into the runtime: their tensors renamed into a `Transformer` (`build`), read from a
folder's safetensors files (never pickle), or taken from an in-memory `transformers` model; which model file
a folder holds (`checkpoint_source`)."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import torch
from torch import nn

from .config import ModelConfig
from .errors import UserError
from .model import Transformer, make_rotary
from .paths import cache_dir

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


def _names(cfg: ModelConfig) -> list:
    """The renaming table of a config's checkpoints."""
    return _OPT_NAMES if cfg.arch == "opt" else (_GEMMA3_NAMES if cfg.sandwich_norms else _LLAMA_NAMES)


def runtime_name(name: str, cfg: ModelConfig) -> str | None:
    """The runtime's name of a checkpoint tensor (None: a tensor the runtime does not hold)."""
    return _rename(name, _names(cfg))


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
        new = runtime_name(name, cfg)
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
        set_submodule(model, prefix, mod)
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


def set_submodule(model: nn.Module, dotted: str, module: nn.Module) -> None:
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


def file_fingerprint(path: Path) -> str:
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
    by transformers from there is the same model; else the config and each weight file's `file_fingerprint`."""
    folder = Path(folder)
    if folder.parent.resolve() == (cache_dir() / "gguf").resolve() and "-" in folder.name:
        return f"gguf:{folder.name.rsplit('-', 1)[1]}"
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f"{f.name}:{file_fingerprint(f)}".encode())
    return f"checkpoint:{h.hexdigest()[:16]}"


def read_safetensors(folder: Path, skip=None) -> dict[str, torch.Tensor]:
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
            raise UserError(f"corrupt or truncated weight file {f}: {e}{cached_hint(folder)}")
    return tensors


def cached_hint(folder: Path) -> str:
    """For a checkpoint we converted into the cache: how to get a good one back."""
    try:
        ours = folder.resolve().is_relative_to((cache_dir() / "gguf").resolve())
    except OSError:
        ours = False
    return f" (a cached conversion: delete {folder} to convert the GGUF file again)" if ours else ""
