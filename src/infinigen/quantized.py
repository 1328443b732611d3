"""Weight-only quantized models: how each projection and the embedding / output table is held for a weight
mode (`wanted_kind`), dense weights re-quantized in place (`quantize_model`: int4 group-wise or int8 per row,
falling back where a kernel cannot take a shape), and the record of what became of each (`WeightsInfo`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .checkpoints import PROJECTIONS, set_submodule
from .kernels.qlinear import GROUP
from .model import Transformer


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


def wanted_kind(mode: str, table: bool, qtype: str | None) -> str:
    """"int4", "int8" or "dense" for a projection (or the embedding/output table) stored as `qtype`
    (a GGUF type name; None for a dense checkpoint)."""
    if mode == "file":
        if qtype in ("Q4_0", "Q4_1") and not table:
            return "int4"
        return "int8" if qtype == "Q8_0" else "dense"
    if mode == "int4":
        return "int8" if table else "int4"  # the output layer keeps 8 bits (llama.cpp keeps >= 6 there)
    return "int8" if mode == "int8" else "dense"


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
            kind = wanted_kind(mode, False, info.file_types.get(name))
            new, info.kinds[name] = _quantized_module(mod.weight, mod.bias, kind, dtype, device, name, info)
            if new is not None:
                set_submodule(model, name, new)
    if (isinstance(model.embed_tokens, nn.Embedding)
            and wanted_kind(mode, True, info.file_types.get("embed_tokens")) != "dense"):
        tied = model.lm_head.weight is model.embed_tokens.weight
        table, info.kinds["embed_tokens"] = _quantized_module(model.embed_tokens.weight, None, "int8", dtype, device,
                                                       "embed_tokens", info)
        if table is not None:
            model.embed_tokens = Int8Embedding(table)
            if tied:
                model.lm_head, info.kinds["lm_head"] = table, "int8"
    if isinstance(model.lm_head, nn.Linear) and wanted_kind(mode, True, info.file_types.get("lm_head")) != "dense":
        head, info.kinds["lm_head"] = _quantized_module(model.lm_head.weight, None, "int8", dtype, device,
                                                        "lm_head", info)
        if head is not None:
            model.lm_head = head
    for name in ("embed_tokens", "lm_head"):
        if isinstance(model.get_submodule(name), Int8Linear | Int8Embedding):
            continue
        info.kinds.setdefault(name, "dense")
    return model


def join_projections(model: Transformer) -> int:
    """Each layer's q, k and v, and its gate and up, as one int4 weight call each where the kernel's layout
    allows (`Int4Linear.joined`: the parts' codes become views of the joined weight's); how many were joined.
    Run once after loading: a decoding step then makes 4 weight calls per layer instead of 7."""
    from .kernels.qlinear import Int4Linear
    joined = 0
    for blk in model.layers:
        groups = [(blk.attn, "qkv_proj", (blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj))]
        if blk.mlp.gated:
            groups.append((blk.mlp, "gate_up_proj", (blk.mlp.gate_proj, blk.mlp.up_proj)))
        for owner, name, parts in groups:
            if all(type(p) is Int4Linear for p in parts):
                module = Int4Linear.joined(parts)
                if module is not None:
                    setattr(owner, name, module)
                    joined += 1
    return joined


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point parameters (norms, dense weights, biases) to the compute dtype; quantized codes
    stay integers and buffers stay as built (the rotary frequencies are float32 on purpose)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def _quantized_module(weight, bias, kind: str, dtype, device, name: str, info: WeightsInfo):
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
