"""Packed 4-bit speculation keys (infinigen.kernels.int4): codec, writes, scorers, bytes, selections."""
from __future__ import annotations

import pytest
import torch

from infinigen.kernels import int4
from infinigen.kernels.int4 import PackedKeys, fake_quantize, pack, quantize, unpack

LAYOUTS = ["rows"] + (["tinygemm"] if int4.tinygemm_ok(64) else [])
METHODS = {"rows": ["reference", "tiled", "algebraic", "bf16"], "tinygemm": ["reference", "tinygemm"]}
# relative to the largest |score|: float32 paths to float rounding; bf16 paths (q, and scores, in bf16)
TOL = {"reference": 1e-6, "tiled": 1e-6, "algebraic": 1e-5, "bf16": 2e-2, "tinygemm": 1e-2, "triton": 1e-5}
CASES = [(layout, m) for layout in LAYOUTS for m in METHODS[layout]]


def keys(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # outlier channels, as skewed keys have: groups of very different ranges
    return torch.randn(*shape, generator=g) * torch.linspace(0.2, 4.0, shape[-1])


def test_pack_unpack_roundtrip():
    c = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    p = pack(c)
    assert p.dtype == torch.uint8 and p.shape == (3, 5, 32)
    assert torch.equal(unpack(p), c)
    assert torch.equal(p[..., 0] & 15, c[..., 0]) and torch.equal(p[..., 0] >> 4, c[..., 1])  # low nibble first


@pytest.mark.parametrize("group", [32, 64, 16])
def test_quantize_matches_fake_int4_reference(group):
    """Dequantized packed codes = group-wise asymmetric fake-int4 with the scale and minimum in float16."""
    x = keys(2, 3, 7, 64)
    codes, scale, lo = quantize(x, group)
    assert codes.shape == (2, 3, 7, 32) and scale.shape == lo.shape == (2, 3, 7, 64 // group)
    assert scale.dtype == lo.dtype == torch.float16
    g = x.unflatten(-1, (64 // group, group))
    mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s16, lo16 = ((mx - mn) / 15).half().float(), mn.half().float()
    ref = (((g - lo16) / s16).round().clamp(0, 15) * s16 + lo16).flatten(-2)
    assert torch.equal(int4.dequantize(codes, scale, lo), ref)
    assert torch.equal(fake_quantize(x, group), ref)
    # and it is a 4-bit quantization: within half a step (plus the float16 rounding of min/scale)
    step = ((mx - mn) / 15).expand_as(g).flatten(-2)
    assert ((ref - x).abs() <= 0.5 * step + 2e-3 * x.abs().amax()).all()


def test_constant_group_is_exact():
    x = torch.full((1, 1, 2, 64), 0.75)
    assert torch.equal(fake_quantize(x), x)
    assert torch.equal(fake_quantize(x, layout="tinygemm"), x) if "tinygemm" in LAYOUTS else True


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_then_dequantize_equals_fake_quant(layout):
    b, h, n, d = 2, 3, 100, 64
    k = keys(b, h, n, d)
    pk = PackedKeys(b, h, 192, d, layout=layout)
    pk.write(0, k[:, :, :70])
    pk.write(70, k[:, :, 70:])  # a write starting mid-block, sharing bytes with the first
    assert torch.equal(pk.dequantize(n), fake_quantize(k, layout=layout))


@pytest.mark.parametrize("layout,method", CASES)
@pytest.mark.parametrize("n", [1, 63, 64, 200, 256])
def test_scores_equal_fake_quant_reference(layout, method, n):
    b, h, G, d = 2, 3, 3, 64
    k = keys(b, h, 256, d, seed=1)
    q = torch.randn(b, h, G, d, generator=torch.Generator().manual_seed(2))
    pk = PackedKeys(b, h, 256, d, layout=layout)
    pk.write(0, k)
    ref = q @ fake_quantize(k[:, :, :n], layout=layout).transpose(-1, -2)
    s = pk.scores(q, n, method)
    assert s.shape == (b, h, G, n) and s.dtype == torch.float32
    assert (s - ref).abs().max() <= TOL[method] * ref.abs().max()


@pytest.mark.parametrize("method", [None, "triton", "tiled", "algebraic"], ids=str)
@pytest.mark.parametrize("n", [1, 63, 64, 200, 256])
def test_scores_on_the_test_device(device, method, n):
    """The rows layout written and scored on the `device` fixture's device (INFINIGEN_TEST_DEVICE=cuda: the
    Triton kernel, the default there): the codes equal the CPU fake-quantization reference's bit for bit,
    and the scores that reference's q . keys (None: the device's default scorer)."""
    if method == "triton" and device.type != "cuda":
        pytest.skip("the Triton scorer runs on CUDA (on CPU: test_triton_scorer_interpreted_on_cpu)")
    b, h, G, d = 2, 3, 3, 64
    k = keys(b, h, 256, d, seed=1)
    q = torch.randn(b, h, G, d, generator=torch.Generator().manual_seed(2))
    pk = PackedKeys(b, h, 256, d, layout="rows", device=device)
    pk.write(0, k.to(device))
    assert torch.equal(pk.dequantize(256).cpu(), fake_quantize(k))
    ref = q @ fake_quantize(k[:, :, :n]).transpose(-1, -2)
    s = pk.scores(q.to(device), n, method)
    assert s.device == pk.codes.device and s.shape == (b, h, G, n) and s.dtype == torch.float32
    if device.type == "cuda" and method is None:
        assert pk.default_method() == "triton"
    assert (s.cpu() - ref).abs().max() <= TOL[method or pk.default_method()] * ref.abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_within_the_4bit_error_of_exact_keys(layout):
    """Whatever the layout (float16 or bf16 scales), the default scorer's scores are q . k up to the
    4-bit rounding: |error| <= sum_i |q_i| * (half a step of k_i's group), plus the scores' own rounding."""
    k = keys(1, 3, 128, 64, seed=3)
    q = torch.randn(1, 3, 3, 64, generator=torch.Generator().manual_seed(4))
    pk = PackedKeys(1, 3, 128, 64, layout=layout)
    pk.write(0, k)
    exact = q @ k.transpose(-1, -2)
    g = k.unflatten(-1, (2, 32))
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(32, -1)  # [1, 3, 128, 64]
    bound = 0.51 * q.abs() @ step.transpose(-1, -2) + 1e-2 * exact.abs().amax()
    assert ((pk.scores(q, 128) - exact).abs() <= bound).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_rewrites_only_those_slots(layout):
    """Pool eviction: each (batch, KV head) appends at its own slot; every other slot keeps its bytes."""
    b, h, cap, d = 2, 3, 128, 64
    k = keys(b, h, cap, d, seed=5)
    pk = PackedKeys(b, h, cap, d, layout=layout)
    pk.write(0, k)
    before = pk.dequantize(cap).clone()
    slots = torch.tensor([[0, 31, 32], [63, 64, 127]])  # both nibbles, block edges
    rows = keys(b, h, 1, d, seed=6) * 3
    pk.scatter(slots, rows)
    after = pk.dequantize(cap)
    hit = torch.zeros(b, h, cap, dtype=torch.bool).scatter_(2, slots[:, :, None], True)
    assert torch.equal(after[~hit], before[~hit])
    got = after.gather(2, slots[:, :, None, None].expand(b, h, 1, d))
    assert torch.equal(got, fake_quantize(rows, layout=layout))
    # and equals writing the same keys in one go
    k2 = k.clone()
    k2.scatter_(2, slots[:, :, None, None].expand(b, h, 1, d), rows)
    assert torch.equal(after, fake_quantize(k2, layout=layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bytes_within_16_percent_of_the_kv(layout):
    """40 B per token and KV head at d 64 (32 B codes, 2 groups x 4 B) against 256 B of K+V in 16 bits."""
    b, h, cap, d = 2, 3, 1024, 64
    pk = PackedKeys(b, h, cap, d, layout=layout)
    kv16 = 2 * b * h * cap * d * 2
    assert pk.nbytes == b * h * cap * 40
    assert pk.nbytes <= 0.16 * kv16
    assert pk.nbytes <= 0.08 * 2 * kv16  # float32 KV


@pytest.mark.parametrize("cap", [1, 36, 100, 1000, 2600, 2625, 8208, 8256])
def test_auto_layout_keeps_the_bound_at_any_capacity(cap):
    """The tinygemm layout pads to whole blocks of 64 tokens; "auto" takes it only within the bound."""
    pk = PackedKeys(1, 3, cap, 64)
    assert pk.nbytes <= 0.16 * 2 * 3 * cap * 64 * 2
    if "tinygemm" in LAYOUTS and (cap % 64 == 0 or cap >= 2625):
        assert pk.layout == "tinygemm"


@pytest.mark.parametrize("layout,method", CASES)
def test_topk_selection_matches_reference(layout, method):
    """The selection from packed scores equals the reference's: any index that differs scores within the
    scorer's tolerance of the k-th reference score (a near tie), and none differ for float32 scorers
    beyond float rounding."""
    b, h, G, d, n, top = 2, 3, 3, 64, 512, 40
    k = keys(b, h, n, d, seed=7)
    q = torch.randn(b, h, G, d, generator=torch.Generator().manual_seed(8))
    pk = PackedKeys(b, h, n, d, layout=layout)
    pk.write(0, k)
    ref = q @ fake_quantize(k, layout=layout).transpose(-1, -2)
    got = pk.scores(q, n, method)
    sel = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, got.topk(top, -1).indices, True)
    want = torch.zeros_like(ref, dtype=torch.bool).scatter_(-1, ref.topk(top, -1).indices, True)
    kth = ref.topk(top, -1).values[..., -1:]
    tol = TOL[method] * ref.abs().amax(-1, keepdim=True) * 2
    differ = sel != want
    assert ((ref - kth).abs()[differ] <= tol.expand_as(ref)[differ]).all()
    if method in ("reference", "tiled", "algebraic"):
        assert differ.sum() <= 2  # random float32 data: at most one swapped near-tie
    assert differ.float().mean() < 0.01


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError):
        PackedKeys(1, 1, 8, 63)
    with pytest.raises(ValueError):
        PackedKeys(1, 1, 8, 64, layout="nope")
    with pytest.raises(ValueError):
        PackedKeys(1, 1, 8, 48, group=32, layout="tinygemm")  # 48 % 32: one group of 48, not a kernel size


TRITON_CHECK = """
import torch
from infinigen.kernels import int4_triton
from infinigen.kernels.int4 import PackedKeys, fake_quantize
g = torch.Generator().manual_seed(9)
b, h, G, d, n = 2, 3, 3, 64, 100
k = torch.randn(b, h, n, d, generator=g) * torch.linspace(0.2, 4.0, d)
q = torch.randn(b, h, G, d, generator=g)
pk = PackedKeys(b, h, 128, d, layout="rows")
pk.write(0, k)
ref = q @ fake_quantize(k).transpose(-1, -2)
s = pk.scores(q, n, "triton")
assert s.shape == ref.shape and (s - ref).abs().max() <= 1e-5 * ref.abs().max(), (s - ref).abs().max()
print("ok")
"""


def test_triton_scorer_interpreted_on_cpu():
    """The CUDA kernel, run by triton's interpreter on CPU (skipped where triton is not installed). In a
    subprocess: TRITON_INTERPRET must be set before triton is first imported."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scores_do_not_depend_on_n_or_on_how_keys_were_written(layout):
    """Decoding scores n cached slots, the teacher-forced path a prefix of them: with the default scorer
    the first m scores are the same bits either way, and a token appended by `scatter` scores as if
    written with the prompt (so `select_rows` may score all rows' prefixes from one write)."""
    b, h, G, d, n = 2, 3, 3, 64, 200
    k = keys(b, h, n, d, seed=11)
    q = torch.randn(b, h, G, d, generator=torch.Generator().manual_seed(12))
    bulk = PackedKeys(b, h, 256, d, layout=layout)
    bulk.write(0, k)
    step = PackedKeys(b, h, 256, d, layout=layout)
    step.write(0, k[:, :, :150])
    for t in range(150, n):
        step.scatter(torch.full((b, h), t), k[:, :, t:t + 1])
    full = bulk.scores(q, n)
    assert torch.equal(step.scores(q, n), full)
    if layout == "tinygemm":  # one kernel call per (batch, KV head); each score its own float32 dot
        for m in (1, 63, 64, 65, 199):
            assert torch.equal(bulk.scores(q, m), full[..., :m])
        # ... and of the other query rows in the call: many decoding rows score in one call
        q2 = torch.cat((q, torch.randn(b, h, 5, d, generator=torch.Generator().manual_seed(13))), 2)
        assert torch.equal(bulk.scores(q2, n)[:, :, :G], full)


@pytest.mark.parametrize("capability", ["avx2"])
def test_other_cpu_builds_fall_back_to_a_correct_layout(capability):
    """torch's int4 kernel packs differently per CPU capability (we write the AVX512 layout in place):
    under another dispatch, the self-check refuses it and the default layout still scores right."""
    import os
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from infinigen.kernels.int4 import PackedKeys, fake_quantize, tinygemm_ok\n"
        "assert not tinygemm_ok(64)\n"
        "k = torch.randn(1, 2, 100, 64); q = torch.randn(1, 2, 3, 64)\n"
        "pk = PackedKeys(1, 2, 128, 64); pk.write(0, k)\n"
        "assert pk.layout == 'rows'\n"
        "ref = q @ fake_quantize(k).transpose(-1, -2)\n"
        "assert (pk.scores(q, 100) - ref).abs().max() <= 1e-5 * ref.abs().max()\n"
        "print('ok')\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
