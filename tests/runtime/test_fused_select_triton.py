"""The fused selecting attention as a Triton kernel (`kernels/fused_select_triton`, what `fused_select.attend_rows`
runs on CUDA), run by triton's interpreter on CPU, against the torch path it stands for (`KVStore.gather_rows`
of the plan `KVStore.select_rows` packs, then `attention.attend_packed`): output and log-sum-exp within 1e-5 in
float32 and the past values' sum, for G 1, 3 and 7, d 64 and 128, batch rows of different lengths (padding),
a KV head that reads nothing but its own token, one split per run and several; and the comparison fails when a
row is dropped, the own token skipped or a query head read against another KV head's rows.

One subprocess runs every case (TRITON_INTERPRET must be set before triton is first imported) and prints each
case's largest errors; the tests read them. Skipped where triton is not installed."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

CHECK = r"""
import json
import torch
from infinigen.cache import KVStore
from infinigen.kernels import fused_select_triton
from infinigen.runtime import attention

def case(b, hkv, g, d, s, ratio, seed, empty_head):
    gen = torch.Generator().manual_seed(seed)
    store = KVStore(1, b, hkv, s + 3, d, torch.float32)
    k = torch.randn(b, hkv, s, d, generator=gen)
    v = torch.randn(b, hkv, s, d, generator=gen)
    valid = torch.rand(b, s, generator=gen) > 0.1
    store.write_prompt(0, k, v, valid, torch.arange(s).expand(b, s))
    keep = torch.rand(b, hkv, s, generator=gen) < ratio
    keep[-1] &= torch.rand(hkv, s, generator=gen) < 0.3  # the last batch row reads fewer rows: padding
    if empty_head:
        keep[0, hkv // 2] = False  # a (batch row, KV head) that reads only its own token
    sel = store.select_rows(0, keep, store.valid[0][:, :, :s])
    q = torch.randn(b, hkv * g, 1, d, generator=gen)
    k1 = torch.randn(b, hkv, 1, d, generator=gen)
    slots = store.append(0, k1, k1 * 0.5, torch.full((b,), s))  # the current token, stored first
    return store, sel, q, slots

def reference(store, sel, q, slots, scale):
    b, h, _, d = q.shape
    hkv = sel.counts.shape[1]
    rows, head = attention.with_own(sel, slots, store.capacity)
    kp, vp = store.gather_rows(0, rows, *attention.StepBuffers().rows(rows.numel(), store.k[0]))
    att = attention.attend_packed(q, kp, vp, head, hkv, scale, remainder=True)
    return att.out.view(b, h, d), att.lse.reshape(b, h), att.read_sum

def errors(shape, splits, breakage=None):
    b, hkv, g, d, s, ratio = shape
    store, sel, q, slots = case(b, hkv, g, d, s, ratio, seed=s + g + d, empty_head=True)
    scale = d ** -0.5
    out_ref, lse_ref, sum_ref = reference(store, sel, q, slots, scale)
    rows, counts, qq = sel.rows, sel.counts.clone(), q.view(b, hkv * g, d)
    own = torch.arange(b * hkv).view(b, hkv) * store.capacity + slots
    if breakage == "drop the last row":
        counts[-1, -1] -= 1
    elif breakage == "skip the own token":
        own = None
    elif breakage == "wrong head":
        qq = qq.roll(g, 1)  # each query head scored against the next KV head's rows
        out_ref, lse_ref = out_ref.roll(g, 1), lse_ref.roll(g, 1)
    assert int(sel.counts[0, hkv // 2]) == 0 and int(sel.counts[-1, -1]) > 0
    assert bool((sel.head == -1).any())  # some batch row is padded
    out, lse, read_sum = fused_select_triton.attend_rows(qq, store.k[0].view(-1, d), store.v[0].view(-1, d),
                                                         rows, counts, own, scale, splits=splits)
    assert out.shape == out_ref.shape and out.dtype == out_ref.dtype and lse.shape == lse_ref.shape
    finite = torch.isfinite(lse_ref)
    return {"out": float((out - out_ref).abs().max()),
            "lse": float((lse - lse_ref)[finite].abs().max()) if bool(finite.any()) else 0.0,
            "lse_inf_mismatch": int((torch.isneginf(lse) != torch.isneginf(lse_ref)).sum()),
            "sum": float((read_sum - sum_ref).abs().max() / max(1.0, float(sum_ref.abs().max()))),
            "longest_run": int(counts.max()) + 1, "block": fused_select_triton.BLOCK_N}

SHAPES = {"G1-d64": (3, 2, 1, 64, 400, 0.4), "G3-d64": (2, 3, 3, 64, 300, 0.5),
          "G7-d128": (2, 2, 7, 128, 300, 0.5), "G3-d128": (3, 4, 3, 128, 200, 0.7)}
report = {}
for name, shape in SHAPES.items():
    for splits in (1, 3):
        report[f"{name}-splits{splits}"] = errors(shape, splits)
for breakage in ("drop the last row", "skip the own token", "wrong head"):
    report[breakage] = errors(SHAPES["G3-d64"], 1, breakage)
print("RESULT " + json.dumps(report))
"""

CASES = [f"{name}-splits{splits}" for name in ("G1-d64", "G3-d64", "G7-d128", "G3-d128") for splits in (1, 3)]
BREAKAGES = ["drop the last row", "skip the own token", "wrong head"]


@pytest.fixture(scope="module")
def interpreted():
    """Every case's largest errors, from one run of the kernel under TRITON_INTERPRET=1 on CPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_torch_path_float32(interpreted, case):
    """Output and log-sum-exp within 1e-5 of `attend_packed` over the gathered rows, the same heads reading
    nothing (-inf), the past values' sum within float rounding; one split per run or three merged."""
    err = interpreted[case]
    assert err["out"] <= 1e-5 and err["lse"] <= 1e-5, err
    assert err["lse_inf_mismatch"] == 0 and err["sum"] <= 1e-5, err
    assert err["longest_run"] > 2 * err["block"]  # three splits: three slices of a run read rows, merged


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_comparison_catches_a_broken_call(interpreted, breakage):
    """The same comparison has teeth: a selected row dropped, the token's own row skipped, or query heads
    read against another KV head's rows each move the output or the log-sum-exp far beyond 1e-5."""
    err = interpreted[breakage]
    assert max(err["out"], err["lse"]) > 1e-3, err
