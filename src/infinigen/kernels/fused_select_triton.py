"""The fused selecting attention of `fused_select.attend_rows` as a Triton kernel for CUDA: one program per
(batch row, KV head, split) reads its chosen key and value rows by index from the layer's flat store (no
gathered copy), scores each block of rows against the KV head's G query heads at once (one dot, G padded to
16 rows), folds it into an online softmax in float32 and reads the token's own row last. With more than one
split per (batch row, KV head) each program covers one slice of the run (equal slices of whole blocks, cut
from the run's own count on the device) and writes its partial output and log-sum-exp; a second kernel merges
the slices (flash-decoding), so a small batch still fills the GPU.

A float32 cache is scored with float32 dots in IEEE precision (no TF32): the result is the CPU kernel's to float
rounding. A 16-bit cache (bfloat16, float16) with queries of its dtype is scored on the tensor cores: the products
of 16-bit values are exact in the float32 accumulator, and the softmax weights are rounded to the values' dtype
for the value product (as flash attention does); `fast_dot=False` keeps the IEEE path for them too.
Indices are not checked on the device (that would cost a host sync per layer); the callers pass the rows
`KVStore.select_rows` packs. Imported lazily (triton is optional); its tests run on CPU under
TRITON_INTERPRET=1 where triton installs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # rows per online-softmax block
TARGET_PROGRAMS = 256  # splits are chosen so that about this many programs run (two per SM on an H100)
MIN_ROWS_PER_SPLIT = 128  # below this a split's merge costs more than the rows it spreads


@triton.jit
def _rows(ptr, far_ptr, far_from, row, c, ok, D: tl.constexpr, FAR: tl.constexpr):
    """Rows `row` [BLOCK] (int64) of the [N, D] tensor at `ptr`, columns `c`, where `ok`; with FAR, a row of
    `far_from` or more is row (row - far_from) of the tensor at `far_ptr` (pinned host memory: read over the bus)."""
    if FAR:
        near = (row < far_from)[:, None]
        at = tl.where(near, row[:, None], 0) * D + c[None, :]
        far = tl.where(near, 0, row[:, None] - far_from) * D + c[None, :]
        x = tl.load(ptr + at, mask=ok & near, other=0) + tl.load(far_ptr + far, mask=ok & ~near, other=0)
    else:
        x = tl.load(ptr + row[:, None] * D + c[None, :], mask=ok, other=0)
    return x


@triton.jit
def _attend_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, counts_ptr, own_ptr, out_ptr, lse_ptr, sum_ptr,
                   far_k_ptr, far_v_ptr, far_from, n_cols, scale,
                   HKV: tl.constexpr, HKV_P2: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                   D: tl.constexpr, D_P2: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
                   HAS_OWN: tl.constexpr, FAST_DOT: tl.constexpr, FAR: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = bh // HKV
    kh = bh % HKV
    # this KV head's run starts after the runs of the heads before it in the batch row
    heads = tl.arange(0, HKV_P2)
    before = tl.load(counts_ptr + b * HKV + heads, mask=heads < kh, other=0)
    start = tl.sum(before, axis=0)
    count = tl.load(counts_ptr + bh)
    total = count  # the past rows, then the token's own row
    if HAS_OWN:
        total = count + 1
    chunk = tl.cdiv(tl.cdiv(total, splits), BLOCK) * BLOCK  # this run's slices: whole blocks, from its count
    lo = split * chunk
    hi = tl.minimum(total, lo + chunk)

    g = tl.arange(0, G_P2)
    c = tl.arange(0, D_P2)
    g_ok = g < G
    c_ok = c < D
    q = tl.load(q_ptr + (bh * G + g)[:, None] * D + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0)
    if not FAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full((G_P2,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D_P2), tl.float32)
    read_sum = tl.zeros((D_P2,), tl.float32)
    for first in range(lo, hi, BLOCK):
        i = first + tl.arange(0, BLOCK)
        live = i < hi
        past = i < count
        row = tl.load(rows_ptr + b * n_cols + start + i, mask=live & past, other=0)
        if HAS_OWN:
            row = tl.where(past, row, tl.load(own_ptr + bh))
        row = row.to(tl.int64)
        ok = live[:, None] & c_ok[None, :]
        k = _rows(k_ptr, far_k_ptr, far_from, row, c, ok, D, FAR)
        v = _rows(v_ptr, far_v_ptr, far_from, row, c, ok, D, FAR)
        read_sum += tl.sum(tl.where(past[:, None], v.to(tl.float32), 0.0), axis=0)
        if FAST_DOT:
            s = tl.dot(q, tl.trans(k)) * scale  # [G_P2, BLOCK], 16-bit products accumulated in float32
        else:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every block holds a live row
        correction = tl.exp(m_i - m_new)  # exp(-inf) = 0 on the first block
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * correction + tl.sum(p, axis=1)
        if FAST_DOT:
            acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    any_read = l_i > 0
    l_safe = tl.where(any_read, l_i, 1.0)
    lse = tl.where(any_read, m_i + tl.log(l_safe), float("-inf"))
    o = acc / l_safe[:, None]
    ok = g_ok[:, None] & c_ok[None, :]
    if not PARTS:
        tl.store(out_ptr + (bh * G + g)[:, None] * D + c[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(lse_ptr + bh * G + g, lse, mask=g_ok)
        tl.store(sum_ptr + bh * D + c, read_sum, mask=c_ok)
    else:  # this slice's part, float32, merged by `_merge_kernel`
        part = bh * splits + split
        tl.store(out_ptr + (part * G + g)[:, None] * D + c[None, :], o, mask=ok)
        tl.store(lse_ptr + part * G + g, lse, mask=g_ok)
        tl.store(sum_ptr + part * D + c, read_sum, mask=c_ok)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, part_sum_ptr, out_ptr, lse_ptr, sum_ptr, splits,
                  G: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr):
    """One program per (batch row, KV head): its slices' outputs weighted by their share of the softmax mass
    (exp(slice lse - lse)), the log-sum-exp of their log-sum-exps, the sum of their value sums."""
    bh = tl.program_id(0)
    g = tl.arange(0, G_P2)
    c = tl.arange(0, D_P2)
    g_ok = g < G
    c_ok = c < D
    m = tl.full((G_P2,), float("-inf"), tl.float32)
    for split in range(splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + (bh * splits + split) * G + g, mask=g_ok, other=float("-inf")))
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # a head that read nothing: every weight exp(-inf) = 0
    l_i = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D_P2), tl.float32)
    read_sum = tl.zeros((D_P2,), tl.float32)
    ok = g_ok[:, None] & c_ok[None, :]
    for split in range(splits):
        part = bh * splits + split
        w = tl.exp(tl.load(part_lse_ptr + part * G + g, mask=g_ok, other=float("-inf")) - m_safe)
        l_i += w
        acc += w[:, None] * tl.load(part_out_ptr + (part * G + g)[:, None] * D + c[None, :], mask=ok, other=0)
        read_sum += tl.load(part_sum_ptr + part * D + c, mask=c_ok, other=0)
    any_read = l_i > 0
    l_safe = tl.where(any_read, l_i, 1.0)
    tl.store(out_ptr + (bh * G + g)[:, None] * D + c[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
             mask=ok)
    tl.store(lse_ptr + bh * G + g, tl.where(any_read, m_safe + tl.log(l_safe), float("-inf")), mask=g_ok)
    tl.store(sum_ptr + bh * D + c, read_sum, mask=c_ok)


def splits_for(pairs: int, rows_per_pair: int) -> int:
    """How many slices each (batch row, KV head) run is cut into: enough programs to fill the GPU, none
    shorter than MIN_ROWS_PER_SPLIT rows."""
    want = max(1, TARGET_PROGRAMS // max(pairs, 1))
    return max(1, min(want, rows_per_pair // MIN_ROWS_PER_SPLIT))


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                counts: torch.Tensor, own: torch.Tensor | None, scale: float, splits: int | None = None,
                block: int = BLOCK_N, num_warps: int = 4, fast_dot: bool | None = None, far=None):
    """As `fused_select.attend_rows`: q [B, H, d]; keys, values [N, d]; rows [B, n] int64 (each batch row's
    runs head-major); counts [B, Hkv]; own [B, Hkv] or None. Returns out [B, H, d] (q's dtype), lse [B, H]
    and read_sum [B, Hkv, d] (float32). `splits`: slices each run is cut into (None: from the shapes and the
    mean run length the packed width gives, without a host sync); `block`, `num_warps`: the launch's (a
    benchmark's sweep); `fast_dot`: the tensor-core dots (None: where the cache and the queries are one 16-bit
    dtype). `far`: (keys, values, split): a row index of `split` or more reads row (index - split) of these [M, d]
    tensors of keys' dtype instead (a pool in pinned host memory, which the GPU reads over the bus: UVA), as if
    they followed `keys` and `values` from row `split` on."""
    b, h, d = q.shape
    hkv = counts.shape[1]
    g = h // hkv
    n = rows.shape[1]
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    rows, counts = rows.contiguous(), counts.contiguous()
    has_own = own is not None
    own = own.contiguous() if has_own else counts  # an unused pointer when there is no own row
    far_k, far_v, far_from = far if far is not None else (keys, values, 0)  # (unused pointers without a far source)
    if splits is None:
        splits = splits_for(b * hkv, triton.cdiv(n, hkv) + 1)
    if fast_dot is None:
        fast_dot = q.dtype == keys.dtype == values.dtype and q.dtype in (torch.bfloat16, torch.float16)
    meta = dict(HKV=hkv, HKV_P2=triton.next_power_of_2(hkv), G=g, G_P2=max(16, triton.next_power_of_2(g)),
                D=d, D_P2=max(16, triton.next_power_of_2(d)), BLOCK=block, PARTS=splits > 1, HAS_OWN=has_own,
                FAST_DOT=bool(fast_dot), FAR=far is not None)
    f32 = dict(dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, **f32)
    read_sum = torch.empty(b, hkv, d, **f32)
    if splits == 1:
        _attend_kernel[(b * hkv, 1)](q, keys, values, rows, counts, own, out, lse, read_sum, far_k, far_v,
                                     int(far_from), n, float(scale), num_warps=num_warps, **meta)
        return out, lse, read_sum
    part_out = torch.empty(b * hkv, splits, g, d, **f32)
    part_lse = torch.empty(b * hkv, splits, g, **f32)
    part_sum = torch.empty(b * hkv, splits, d, **f32)
    _attend_kernel[(b * hkv, splits)](q, keys, values, rows, counts, own, part_out, part_lse, part_sum, far_k,
                                      far_v, int(far_from), n, float(scale), num_warps=num_warps, **meta)
    _merge_kernel[(b * hkv,)](part_out, part_lse, part_sum, out, lse, read_sum, splits,
                              G=g, G_P2=meta["G_P2"], D=d, D_P2=meta["D_P2"])
    return out, lse, read_sum


@triton.jit
def _gather_kernel(near_ptr, far_ptr, index_ptr, out_ptr, split, n, D: tl.constexpr, D_P2: tl.constexpr,
                   BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.arange(0, D_P2)
    live = i < n
    row = tl.load(index_ptr + i, mask=live, other=0).to(tl.int64)
    ok = live[:, None] & (c < D)[None, :]
    x = _rows(near_ptr, far_ptr, split, row, c, ok, D, True)
    tl.store(out_ptr + i.to(tl.int64)[:, None] * D + c[None, :], x, mask=ok)


def gather_rows(near: torch.Tensor, far: torch.Tensor, split: int, index: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `index` [n] of `near` [N, d], an index of `split` or more reading row (index - split) of `far` [M, d]
    (pinned host memory: read over the bus) -> [n, d] (into `out`): what `attend_rows` reads with a far source,
    for a caller that gathers the rows first."""
    n, d = index.numel(), near.shape[1]
    out = torch.empty((n, d), dtype=near.dtype, device=near.device) if out is None else out
    block = 32
    if n:
        _gather_kernel[(triton.cdiv(n, block),)](near.contiguous(), far.contiguous(), index.contiguous(), out,
                                                 int(split), n, D=d, D_P2=max(16, triton.next_power_of_2(d)),
                                                 BLOCK=block)
    return out
