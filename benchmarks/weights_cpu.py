"""Weights as the GGUF stores them against dequantized weights, on the CPU.

Default model (SmolLM2-135M-Instruct, Q4_1), three ways of holding it, all in one process:

  fp32        the GGUF dequantized to float32, float32 compute (the earlier default)
  bf16        the GGUF dequantized to bfloat16, bfloat16 compute
  int4+bf16   the file's Q4_1 blocks as int4 and its Q8_0 table as int8, bfloat16 compute (the new default
              where the CPU has AVX512-BF16 or AMX)

For each: the bytes of the runtime model's parameters and buffers against the GGUF's tensor bytes, and a
chat-like run at batch 1 (a ~500-token chat prompt from Pride and Prejudice, 64 new tokens, greedy, no
stop at EOS so every run decodes 64): prefill and decode tokens/s, the variants interleaved over
`--rounds` rounds (A B C A B C ...; the table gives the median and the spread). The machine is shared:
the load average is printed with the numbers.

    PYTHONPATH=src python benchmarks/weights_cpu.py [--threads 1] [--rounds 3] \\
        [--json results/weights_cpu/weights_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from infinigen.generate import encode_prompts, generate_ids
from infinigen.kernels.qlinear import weight_bytes
from infinigen.loading import default_gguf, load
from infinigen.paths import load_text

VARIANTS = {"fp32": dict(dtype="float32", weights="fp32"),
            "bf16": dict(dtype="bfloat16", weights="bf16"),
            "int4+bf16": dict(dtype="bfloat16", weights="auto")}
TEXT = Path(__file__).resolve().parents[1] / "src" / "infinigen" / "data" / "austen" / "prideprejudice.txt"


def chat_prompt(tok, tokens: int) -> list[int]:
    """A chat prompt of about `tokens` tokens: a passage and a question about it."""
    body = load_text(TEXT)
    start = body.find("It is a truth universally acknowledged")
    words = body[start:].split()
    lo, hi = 1, len(words)
    while lo < hi:  # the longest passage whose chat prompt stays within `tokens`
        mid = (lo + hi + 1) // 2
        ids = encode_prompts(tok, [" ".join(words[:mid]) + "\n\nWho is Mr. Bingley, in one sentence?"], chat=True)[0]
        lo, hi = (mid, hi) if len(ids) <= tokens else (lo, mid - 1)
    return encode_prompts(tok, [" ".join(words[:lo]) + "\n\nWho is Mr. Bingley, in one sentence?"], chat=True)[0]


def cpu_name() -> str:
    """The CPU model and its bfloat16 features, from /proc/cpuinfo where there is one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores{', ' + ', '.join(bf16) if bf16 else ''}"


def gguf_tensor_bytes() -> int:
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(default_gguf()).tensors)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    models = {}
    for name, kw in VARIANTS.items():
        model, tok, _ = load("default", progress=False, **kw)
        models[name] = model
    prompt = chat_prompt(tok, args.prompt_tokens)
    file_bytes = gguf_tensor_bytes()
    runs = {name: [] for name in models}
    texts = {}
    for name, model in models.items():  # warm-up: first-call allocations and dispatch
        generate_ids(model, [prompt], 4)
    for r in range(args.rounds):
        for name, model in models.items():
            g = generate_ids(model, [prompt], args.new_tokens, eos=frozenset())
            assert g.decode_steps == args.new_tokens - 1, g.decode_steps
            runs[name].append({"prefill_tok_s": len(prompt) / g.prefill_s, "decode_tok_s": g.decode_tokens_per_s})
            texts[name] = tok.decode(g.tokens[0], skip_special_tokens=True)
            print(f"round {r + 1} {name}: prefill {runs[name][-1]['prefill_tok_s']:.0f} tok/s, "
                  f"decode {runs[name][-1]['decode_tok_s']:.1f} tok/s (load {os.getloadavg()[0]:.2f})", flush=True)

    rows = []
    for name, model in models.items():
        dec = [x["decode_tok_s"] for x in runs[name]]
        pre = [x["prefill_tok_s"] for x in runs[name]]
        wb = weight_bytes(model)
        rows.append({"variant": name, "weights": model.weights_info.summary(), "weight_bytes": wb,
                     "x_gguf": wb / file_bytes, "decode_tok_s_median": statistics.median(dec),
                     "decode_tok_s": dec, "prefill_tok_s_median": statistics.median(pre), "prefill_tok_s": pre,
                     "answer": texts[name]})
    out = {"machine": cpu_name(), "torch": torch.__version__,
           "threads": args.threads, "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
           "rounds": args.rounds, "gguf_tensor_bytes": file_bytes, "load_average_end": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    print(f"\n{out['machine']}, torch {torch.__version__}; prompt {len(prompt)} tokens, {args.new_tokens} new, "
          f"batch 1, {args.threads} thread(s), GGUF tensor bytes {file_bytes / 1e6:.1f} MB\n")
    print("| variant | weights in memory | x GGUF | decode tok/s (median; runs) | prefill tok/s (median) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['weight_bytes'] / 1e6:.1f} MB | {r['x_gguf']:.2f} | "
              f"{r['decode_tok_s_median']:.1f} ({', '.join(f'{x:.1f}' for x in r['decode_tok_s'])}) | "
              f"{r['prefill_tok_s_median']:.0f} |")
    for r in rows:
        print(f"\n{r['variant']} ({r['weights']}): {r['answer']!r}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
