"""Triton scorer for `PackedKeys(layout="rows")` on CUDA: one program per (batch x KV head, BLOCK_N tokens)
loads the tile's codes (d/2 bytes per token) and float16 scale/minimum, dequantizes in registers and
reduces against the G query heads; float keys never reach memory. Imported lazily (triton is optional);
its tests run on CPU under TRITON_INTERPRET=1 where triton installs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64


@triton.jit
def _scores_kernel(q_ptr, codes_ptr, scale_ptr, lo_ptr, out_ptr, n, cap,
                   G: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = tok < n
    j = tl.arange(0, D // 2)  # byte j: dims 2j (low nibble) and 2j + 1 (high), both in group 2j // GROUP
    NG: tl.constexpr = D // GROUP
    c = tl.load(codes_ptr + bh * cap * (D // 2) + tok[:, None] * (D // 2) + j[None, :], mask=m[:, None], other=0)
    sp = bh * cap * NG + tok[:, None] * NG + ((2 * j) // GROUP)[None, :]
    s = tl.load(scale_ptr + sp, mask=m[:, None], other=0).to(tl.float32)
    z = tl.load(lo_ptr + sp, mask=m[:, None], other=0).to(tl.float32)
    k_even = (c & 15).to(tl.float32) * s + z
    k_odd = (c >> 4).to(tl.float32) * s + z
    for g in tl.static_range(G):
        qe = tl.load(q_ptr + (bh * G + g) * D + 2 * j)
        qo = tl.load(q_ptr + (bh * G + g) * D + 2 * j + 1)
        acc = tl.sum(k_even * qe[None, :] + k_odd * qo[None, :], axis=1)
        tl.store(out_ptr + (bh * G + g) * n + tok, acc, mask=m)


def supported(d: int) -> bool:
    return d >= 4 and (d // 2) & (d // 2 - 1) == 0  # tl.arange needs a power of two


def scores(pk, q: torch.Tensor, n: int) -> torch.Tensor:
    b, h, G, d = q.shape
    q = q.float().contiguous()
    out = torch.empty(b, h, G, n, dtype=torch.float32, device=q.device)
    if n:
        grid = (b * h, triton.cdiv(n, BLOCK_N))
        _scores_kernel[grid](q, pk.codes, pk.scale, pk.lo, out, n, pk.capacity,
                             G=G, D=d, GROUP=pk.group, BLOCK=BLOCK_N)
    return out
