"""A high-GQA test model made offline: the default model (SmolLM2-135M, 9 query heads over 3 KV heads) with each
layer's KV heads mean-pooled to fewer (`--kv-heads 1`: 9 query heads per KV head), written as a Hugging Face
safetensors checkpoint folder that every command's `--model` takes.

Pooling the key and value projections' rows head by head gives a KV head whose keys and values are the mean of
the pooled heads' (the rotary rotation is linear); it is how a model is first turned into a GQA one, before
training repairs it. Untrained, the model loses accuracy: compare its full-cache perplexity with the original's
before reading anything into its selection's.

    python benchmarks/gqa_pooled_model.py --kv-heads 1 --out /tmp/smollm2-gqa9
    infinigen ppl --model /tmp/smollm2-gqa9 --text northangerabbey --ctx 2048 --prefill 256
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from safetensors.torch import load_file, save_file

KV_PROJECTION = re.compile(r"^(model\.)?layers\.\d+\.self_attn\.(k|v)_proj\.(weight|bias)$")
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def pooled(tensors: dict, kv_heads: int, new_kv_heads: int, head_dim: int) -> dict:
    """The checkpoint's tensors with the key and value projections' KV heads mean-pooled in consecutive groups
    (query head h reads KV head h // (heads / KV heads) before and after: the groups keep that mapping)."""
    group = kv_heads // new_kv_heads
    out = {}
    for name, t in tensors.items():
        if KV_PROJECTION.match(name):
            rows = t.reshape(new_kv_heads, group, head_dim, *t.shape[1:]).float().mean(1)
            t = rows.reshape(new_kv_heads * head_dim, *t.shape[1:]).to(t.dtype).contiguous()
        out[name] = t
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-heads", type=int, default=1, help="KV heads per layer after pooling")
    ap.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write (must not exist)")
    ap.add_argument("--source", type=Path, help="an HF checkpoint folder (default: the default model's)")
    args = ap.parse_args(argv)
    if args.out.exists():
        print(f"error: {args.out} exists", file=sys.stderr)
        return 2
    if args.source is None:
        from infinigen.gguf_model import convert_gguf, default_gguf
        args.source = convert_gguf(default_gguf(), progress=False)
    config = json.loads((args.source / "config.json").read_text())
    kv, heads = config["num_key_value_heads"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if args.kv_heads < 1 or kv % args.kv_heads:
        print(f"error: --kv-heads must divide the model's {kv} KV heads", file=sys.stderr)
        return 2
    files = sorted(args.source.glob("model*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
    out = pooled(tensors, kv, args.kv_heads, head_dim)
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(out, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config | {"num_key_value_heads": args.kv_heads}, indent=2))
    for name in COPIED:
        if (args.source / name).exists():
            shutil.copy(args.source / name, tmp / name)
    tmp.rename(args.out)
    print(f"{args.out}: {heads} query heads over {args.kv_heads} KV heads (was {kv}), head_dim {head_dim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
