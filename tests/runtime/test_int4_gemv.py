"""The native int4 weight kernel (kernels/int4_gemv) against torch's int4 kernel and the float64 product with the
dequantized weight: float32 within 1e-5, bfloat16 within one rounding of the output; each row's bits independent
of the rows beside it and of the threads; and `Int4Linear` calls it for a decoding batch only. The same for the
int8 table's kernel (`Int8Linear`)."""
from __future__ import annotations

import pytest
import torch

from infinigen import compiled
from infinigen.bench.dispatch import DispatchedCalls
from infinigen.kernels import int4_gemv
from infinigen.kernels.qlinear import Int4Linear, Int8Linear, _cpu_layout_known
from infinigen.quantized import join_projections, quantize_model
from support.models import build_tiny, decoded_logits

BF16_ULP = 2.0 ** -8


def _needs(dtype):
    if not _cpu_layout_known() or not int4_gemv.available(dtype):
        pytest.skip(f"no native int4 kernel for {dtype} here (AVX-512 and a C++ compiler)")


def _module(n: int, k: int, group: int, dtype, seed: int = 0) -> Int4Linear:
    """Codes, scales and zeros drawn independently (every code 0..15 in every group, zeros of either sign), so a
    wrong group, nibble or column shows in the product."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, k // group, generator=g) / 8 + 0.01
    zero = torch.randn(n, k // group, generator=g) / 4
    return Int4Linear.from_codes(codes, scale, zero, dtype)


def _product(m: Int4Linear, x: torch.Tensor, native: bool) -> torch.Tensor:
    if native:
        return int4_gemv.int4_gemv(x, m.packed, m.group, m.scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, m.packed, m.group, m.scale_zero)


SHAPES = [(64, 64, 32), (192, 96, 32), (960, 576, 32), (576, 1536, 32), (128, 256, 64), (64, 256, 128),
          (64, 512, 256)]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_float32_equals_the_dequantized_product(n, k, group, rows):
    _needs(torch.float32)
    m = _module(n, k, group, torch.float32, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ m.dequantize(torch.float32).double().T
    for native in (True, False):
        y = _product(m, x, native)
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), native


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_bfloat16_within_one_rounding_of_the_dequantized_product(n, k, group, rows):
    """Each output within half a bfloat16 step of the float64 product (its one rounding) plus the float32 sums'
    error, as torch's kernel is: both bounded by the same |x| |w| budget."""
    _needs(torch.bfloat16)
    m = _module(n, k, group, torch.bfloat16, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    w = m.dequantize(torch.float32).double()
    ref = x.double() @ w.T
    bound = BF16_ULP * (x.double().abs() @ w.abs().T) + 1e-6
    native, reference = _product(m, x, True), _product(m, x, False)
    assert native.dtype == torch.bfloat16 and native.shape == (rows, n)
    assert ((native.double() - ref).abs() <= bound).all()
    assert ((reference.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_alone_beside_others_and_on_any_threads(dtype):
    """A row's arithmetic depends on nothing beside it (the server's batch-invariant step relies on it)."""
    _needs(dtype)
    m = _module(576, 1536, 32, dtype, seed=3)
    x = torch.randn(8, 1536, generator=torch.Generator().manual_seed(4)).to(dtype)
    together = _product(m, x, True)
    for r in range(8):
        assert torch.equal(_product(m, x[r:r + 1], True)[0], together[r])
        assert torch.equal(_product(m, x[:r + 1], True)[r], together[r])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _product(m, x, True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


@pytest.mark.parametrize("rows,native", [(1, True), (8, True), (9, False), (65, False)])
def test_int4_linear_runs_it_for_a_decoding_batch_only(rows, native):
    _needs(torch.bfloat16)
    m = _module(128, 64, 32, torch.bfloat16)
    x = torch.randn(rows, 64).bfloat16()
    with DispatchedCalls(watched=(m.packed,)) as seen:
        m(x)
    assert any("infinigen.int4_gemv" in name for name in seen.on_watched) == native
    if rows <= 64:
        assert any("_weight_int4pack_mm_for_cpu" in name for name in seen.on_watched) == (not native)


def test_a_tail_block_and_the_switch_keep_torch_kernel(monkeypatch):
    """Outputs not in whole 64-row blocks (the layout's tail), or the module's switch off: torch's kernel."""
    _needs(torch.bfloat16)
    tail = _module(80, 64, 32, torch.bfloat16)
    x = torch.randn(1, 64).bfloat16()
    with DispatchedCalls(watched=(tail.packed,)) as seen:
        tail(x)
    assert not any("infinigen" in name for name in seen.on_watched)
    whole = _module(64, 64, 32, torch.bfloat16)
    monkeypatch.setattr(int4_gemv, "enabled", False)
    with DispatchedCalls(watched=(whole.packed,)) as seen:
        whole(x)
    assert not any("infinigen" in name for name in seen.on_watched)


def test_refuses_what_it_cannot_take():
    _needs(torch.float32)
    m = _module(64, 64, 32, torch.float32)
    with pytest.raises(RuntimeError, match="rows"):
        int4_gemv.int4_gemv(torch.randn(9, 64), m.packed, m.group, m.scale_zero)
    with pytest.raises(RuntimeError, match="dtype"):
        int4_gemv.int4_gemv(torch.randn(1, 64).bfloat16(), m.packed, m.group, m.scale_zero)


# ---- the int8 table (one scale per output row) ----------------------------------------------------------------
def _int8_table(n: int, k: int, dtype) -> Int8Linear:
    g = torch.Generator().manual_seed(n + k)
    return Int8Linear.quantize(torch.randn(n, k, generator=g), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(49152 // 64, 576), (100, 64), (7, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 8])
def test_int8_equals_the_dequantized_product(dtype, n, k, rows):
    """float32 within 1e-5 of the float64 product; bfloat16 within one rounding of the output plus the sums'."""
    _needs(dtype)
    table = _int8_table(n, k, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    w = table.dequantize(torch.float32).double()
    ref = x.double() @ w.T
    y = int4_gemv.int8_gemv(x, table.qweight, table.scales)
    assert y.dtype == dtype and y.shape == (rows, n)
    if dtype == torch.float32:
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    else:
        assert ((y.double() - ref).abs() <= BF16_ULP * (x.double().abs() @ w.abs().T) + 1e-6).all()
    for r in range(rows):  # a row's bits do not depend on the rows beside it
        assert torch.equal(int4_gemv.int8_gemv(x[r:r + 1], table.qweight, table.scales)[0], y[r])


@pytest.mark.parametrize("rows,native", [(1, True), (8, True), (9, False)])
def test_int8_linear_runs_it_for_a_decoding_batch_only(rows, native):
    _needs(torch.bfloat16)
    table = _int8_table(64, 64, torch.bfloat16)
    with DispatchedCalls(watched=(table.qweight,)) as seen:
        table(torch.randn(rows, 64).bfloat16())
    assert any("infinigen.int8_gemv" in name for name in seen.on_watched) == native
    assert any("_weight_int8pack_mm" in name for name in seen.on_watched) == (not native)


# ---- inside the compiled step ---------------------------------------------------------------------------------
_logits = decoded_logits


def test_the_compiled_whole_step_calls_it_and_decodes_torch_kernels_logits(private_inductor_cache, monkeypatch):
    """float32 int4 weights in whole 64-row blocks: the compiled whole step calls the native op (traced in through
    its fake implementation) and its logits are within 1e-5 of the eager step's with torch's kernel."""
    _needs(torch.float32)
    model = build_tiny("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=128)[1]
    quantize_model(model, "int4", torch.float32, "cpu")
    assert join_projections(model) == 2 * model.cfg.num_layers
    tokens = torch.randint(3, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(int4_gemv, "enabled", False)
    with torch.inference_mode():
        want = _logits(model, tokens)
    monkeypatch.setattr(int4_gemv, "enabled", True)
    parts = compiled.enable(model, "on")
    try:
        with torch.inference_mode():
            got = _logits(model, tokens)  # compiles (a dispatch mode would see the tracing's fake tensors)
            with DispatchedCalls(watched=(model.layers[0].mlp.down_proj.packed,)) as seen:
                again = _logits(model, tokens)
    finally:
        compiled.disable(model)
    assert parts.failed is None and parts.compiled > 0
    assert "infinigen.int4_gemv.default" in seen.on_watched
    assert torch.equal(again, got)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


# ---- odd shapes and batches of the bfloat16 block kernel and the int8 table's row groups ----------------------
ODD_SHAPES = [(64, 96, 32), (320, 96, 32), (192, 160, 32), (128, 192, 64), (320, 384, 128), (64, 768, 256)]


@pytest.mark.parametrize("n,k,group", ODD_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_bfloat16_blocks_at_odd_shapes_and_batches(n, k, group, rows):
    """One block, an odd number of blocks (split unevenly over threads), an odd number of groups, every group size,
    batches 1 to 5 (a second pass of rows): within one rounding of the float64 product and of torch's kernel's
    bound, and each row the same bits computed alone."""
    _needs(torch.bfloat16)
    m = _module(n, k, group, torch.bfloat16, seed=7 * n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k)).bfloat16()
    w = m.dequantize(torch.float32).double()
    ref = x.double() @ w.T
    bound = BF16_ULP * (x.double().abs() @ w.abs().T) + 1e-6
    native = _product(m, x, True)
    assert ((native.double() - ref).abs() <= bound).all()
    assert ((native.double() - _product(m, x, False).double()).abs() <= 2 * bound).all()
    for r in range(rows):
        assert torch.equal(_product(m, x[r:r + 1], True)[0], native[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [5, 100, 49152 // 64 + 13])
@pytest.mark.parametrize("k", [576, 48])
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_int8_row_groups_at_odd_counts(dtype, n, k, rows):
    """Tables whose rows are not whole groups of four or eight nor whole tasks, at batches 1 to 5 (eight rows
    together at one or two, four beyond), K a multiple of 32 and not: within the
    bound of the float64 product, each row alone the same bits."""
    _needs(dtype)
    table = _int8_table(n, k, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n + rows)).to(dtype)
    w = table.dequantize(torch.float32).double()
    ref = x.double() @ w.T
    y = int4_gemv.int8_gemv(x, table.qweight, table.scales)
    if dtype == torch.float32:
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    else:
        assert ((y.double() - ref).abs() <= BF16_ULP * (x.double().abs() @ w.abs().T) + 1e-6).all()
    for r in range(rows):
        assert torch.equal(int4_gemv.int8_gemv(x[r:r + 1], table.qweight, table.scales)[0], y[r])
