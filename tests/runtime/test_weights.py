"""Weights as the file stores them (int4 / int8 through torch's weight-only
kernels, infinigen.kernels.qlinear) and the compute dtype chosen by the hardware (dtype "auto").

Fast tests use synthetic matrices, GGUF blocks made by `gguf.quants.quantize` and tiny checkpoints; the
`integration` tests use the default model's own GGUF file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from infinigen import runtime
from infinigen import UserError, load
from infinigen import loading
from infinigen import precision
from infinigen.kernels import qlinear
from infinigen.kernels.qlinear import (DENSE_ROWS, DequantizedView, Int4Linear, Int8Embedding, Int8Linear,
                                       decode_q4, decode_q8_0, int4_problem, parameter_count, weight_bytes)
from infinigen.placement import Placement

from support.models import build_tiny, make_tokenizer

gguf = pytest.importorskip("gguf")
BF16_ULP = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding moves a value by at most 2^-9 of it


def weights(n, k, seed=0):
    """Rows of very different ranges, like trained projections (an outlier input column too)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.02, 0.3, n)[:, None]
    w[:, 3] *= 8
    return w


def inputs(rows, k, seed=1):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


def gguf_blocks(w: torch.Tensor, qtype: str) -> np.ndarray:
    return gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])


def gguf_dequantize(blocks: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]).copy())


def within_rounding(y, x, w, bits_lost: float = 1.0):
    """|y - x W^T| within `bits_lost` bfloat16 roundings of the terms (|x| |W|^T): the bound of rounding
    each weight once and the output once."""
    ref = x.double() @ w.double().T
    bound = bits_lost * BF16_ULP * (x.double().abs() @ w.double().abs().T) + 1e-6
    return bool(((y.double() - ref).abs() <= bound).all())


# ---- int4: the kernel against the dequantized weights -------------------------------------------------
@pytest.mark.parametrize("n,k", [(64, 64), (192, 96), (80, 128), (48, 32)],
                         ids=["block", "3blocks", "tail16", "tail48"])
def test_int4_kernel_matches_its_dequantized_weights_float32(n, k):
    """Float32 compute: the kernel's product equals the float32 matmul with the dequantized weights (only
    the summation order differs), for few rows (the kernel) and many (dequantize + dense matmul)."""
    m = Int4Linear.quantize(weights(n, k), 32, torch.float32)
    w = m.dequantize(torch.float32)
    assert m.weight.shape == (n, k) and torch.equal(m.weight, w)
    for rows in (1, 3, DENSE_ROWS + 5):
        x = inputs(rows, k)
        y = m(x)
        ref = x.double() @ w.double().T
        assert y.dtype == torch.float32 and y.shape == (rows, n)
        assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("rows", [1, 4, DENSE_ROWS + 1])
def test_int4_kernel_matches_its_dequantized_weights_bfloat16(rows):
    """bfloat16 compute: within the output's rounding (kernel) or the weights' and output's (the dense
    path rounds the dequantized weights to bfloat16)."""
    n, k = 192, 96
    m = Int4Linear.quantize(weights(n, k), 32, torch.bfloat16)
    x = inputs(rows, k).bfloat16()
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert within_rounding(y, x, m.dequantize(torch.float32), bits_lost=1.0)


def test_int4_quantize_is_within_half_a_step():
    w = weights(64, 128)
    m = Int4Linear.quantize(w, 32, torch.float32)
    codes = m.codes()
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    step = m.scale_zero[..., 0].T.repeat_interleave(32, 1)  # [N, K]
    assert ((m.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert m.packed.numel() == 64 * 128 // 2  # two codes per byte


def test_int4_bias_and_leading_dims():
    w, b = weights(64, 64), torch.randn(64)
    m = Int4Linear.quantize(w, 32, torch.float32, bias=b)
    x = torch.randn(2, 3, 64)
    assert torch.allclose(m(x), x @ m.dequantize().T + b, atol=1e-5)


def test_int4_refuses_a_wrong_input_dtype():
    m = Int4Linear.quantize(weights(64, 64), 32, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        m(torch.randn(1, 64))


# ---- GGUF blocks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_decode_as_gguf_dequantizes_them(qtype):
    """Our decoding of Q4_0/Q4_1 blocks (scale d, zero m + 8d or 0; low nibbles first) gives gguf's own
    dequantized values exactly, and so does the module built from them in float32."""
    w = weights(64, 96)
    blocks = gguf_blocks(w, qtype)
    ref = gguf_dequantize(blocks, qtype)
    codes, scale, zero = decode_q4(blocks, qtype)
    mine = ((codes.view(64, 3, 32).float() - 8) * scale[..., None] + zero[..., None]).view(64, 96)
    assert torch.equal(mine, ref)
    m = Int4Linear.from_gguf_blocks(blocks, qtype, torch.float32)
    assert torch.equal(m.dequantize(torch.float32), ref)
    x = inputs(3, 96)
    assert (m(x) - x @ ref.T).abs().max().item() <= 1e-5 * (x @ ref.T).abs().max().item()


def test_gguf_q4_1_nibble_order_by_hand():
    """One hand-made Q4_1 block: d = 1, m = 0, byte j = (j) | (15 - j) << 4: elements 0..15 are the low
    nibbles (j), elements 16..31 the high ones (15 - j)."""
    block = np.zeros((1, 20), dtype=np.uint8)
    block[0, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    block[0, 4:] = [j | (15 - j) << 4 for j in range(16)]
    want = [float(j) for j in range(16)] + [float(15 - j) for j in range(16)]
    assert gguf_dequantize(block, "Q4_1").flatten().tolist() == want  # gguf agrees with the layout
    assert Int4Linear.from_gguf_blocks(block.repeat(16, 0), "Q4_1", torch.float32).dequantize()[0].tolist() == want


def test_gguf_q8_0_to_int8_rows():
    """Q8_0 keeps a scale per 32 inputs, the int8 kernel one per row: the re-quantized rows are within
    half a row step of gguf's values (and decoding the blocks is exact)."""
    w = weights(48, 128)
    blocks = gguf_blocks(w, "Q8_0")
    ref = gguf_dequantize(blocks, "Q8_0")
    assert torch.equal(decode_q8_0(blocks), ref)
    m = Int8Linear.from_gguf_blocks(blocks, "Q8_0", torch.float32)
    step = m.scales.float()[:, None]
    assert ((m.dequantize() - ref).abs() <= step / 2 + 1e-7).all()


def test_gguf_row_order_commutes_with_dequantization():
    """llama.cpp stores q/k rows permuted for its RoPE; transformers un-permutes the dequantized matrix.
    Reordering the raw blocks with `gguf_row_order` (transformers' own processor run on row indices)
    gives the same matrix."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    hf = build_tiny("llama")[0].config  # 8 query heads, 2 KV heads, head_dim 8
    cfg = loading.ModelConfig.from_hf(hf)
    proc = LlamaTensorProcessor(config={"num_attention_heads": 8, "num_key_value_heads": 2})
    for name, rows in (("blk.0.attn_q.weight", 64), ("blk.0.attn_k.weight", 16), ("blk.0.ffn_up.weight", 128)):
        blocks = gguf_blocks(weights(rows, 64), "Q4_1")
        theirs = proc.process(weights=gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1), name=name).weights
        order = loading.gguf_row_order("llama", cfg, name, rows)
        mine = Int4Linear.from_gguf_blocks(blocks[order], "Q4_1", torch.float32).dequantize()
        assert torch.equal(mine, torch.from_numpy(np.ascontiguousarray(theirs)))
        assert (name == "blk.0.ffn_up.weight") == bool((order == np.arange(rows)).all())  # only q/k move


# ---- int8 and the view ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, DENSE_ROWS + 1])
def test_int8_kernel_matches_its_dequantized_weights(dtype, rows):
    m = Int8Linear.quantize(weights(100, 64), dtype)  # no shape constraint: N = 100
    x = inputs(rows, 64).to(dtype)
    y = m(x)
    assert y.dtype == dtype
    assert within_rounding(y, x, m.dequantize(torch.float32), bits_lost=1.0 if dtype == torch.bfloat16 else 1e-2)


def test_int8_embedding_shares_the_table():
    table = Int8Linear.quantize(weights(300, 32), torch.bfloat16)
    emb = Int8Embedding(table)
    ids = torch.tensor([[0, 5, 299]])
    assert torch.equal(emb(ids), table.dequantize()[ids])
    both = nn.ModuleList([emb, table])
    assert weight_bytes(both) == 300 * 32 + 300 * 2  # one table, counted once
    assert parameter_count(both) == 300 * 32


def test_weight_view_reads_dequantized_and_refuses_writes():
    m = Int4Linear.quantize(weights(64, 64), 32, torch.bfloat16)
    view = m.weight
    assert isinstance(view, DequantizedView) and view.dtype == torch.bfloat16 and view.shape == (64, 64)
    assert torch.equal(view.detach().float(), m.dequantize(torch.float32).bfloat16().float())
    with pytest.raises(RuntimeError, match="read-only"):
        with torch.no_grad():
            m.weight.copy_(torch.zeros(64, 64))
    with pytest.raises(RuntimeError, match="read-only"):
        with torch.no_grad():
            m.weight.mul_(2)


def test_cpu_layout_is_read_where_torch_packs_for_avx512(monkeypatch):
    """On AVX512 builds we read the kernel's packed codes back (the fast dequantization of long prompts);
    anywhere else (or if torch changes its layout) the kernel itself dequantizes, with the same values."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        assert qlinear._cpu_layout_known()
    m = Int4Linear.quantize(weights(80, 64), 32, torch.float32)
    fast = m.dequantize()
    monkeypatch.setattr(qlinear, "_cpu_layout_known", lambda: False)
    # the kernel forms (code - 8) * scale + zero, we form code * scale + (zero - 8 scale): float32 ulps apart
    assert (m.dequantize() - fast).abs().max().item() <= 1e-6 * fast.abs().max().item()
    x = inputs(DENSE_ROWS + 3, 64)
    assert (m(x) - x @ fast.T).abs().max().item() <= 1e-5 * (x @ fast.T).abs().max().item()


def test_int4_problem_names_the_shape():
    assert int4_problem(576, 576, 32, "cpu") is None and int4_problem(1536, 576, 32, "cpu") is None
    assert int4_problem(576, 1536, 32, "cpu") is None and int4_problem(192, 576, 32, "cpu") is None
    assert "multiple of 16" in int4_problem(8, 64, 32, "cpu")
    assert "group" in int4_problem(64, 48, 32, "cpu")
    assert "576" in int4_problem(64, 576, 128, "cpu")  # why SmolLM2 re-quantizes with group 32, not 128


# ---- the compute dtype ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_follows_the_hardware(monkeypatch, bf16):
    monkeypatch.setattr(precision, "_cpu_has_bf16", lambda: bf16)
    assert loading.auto_dtype("cpu") == ("bfloat16" if bf16 else "float32")
    assert loading.auto_dtype("cuda") == "bfloat16"  # any CUDA GPU
    dtype, mode = loading.resolve_precision("auto", "auto", "cpu")
    assert (dtype, mode) == ((torch.bfloat16, "file") if bf16 else (torch.float32, "dense"))
    from infinigen.commands.options import resolve_dtype
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if bf16 else "float32")
    assert resolve_dtype("float16", "cpu") == "float16"  # --dtype still overrides


def test_cpu_bf16_probe_reads_the_cpu_flags(monkeypatch):
    """Without torch's probes the Linux flags decide."""
    precision._cpu_has_bf16.cache_clear()
    try:
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
            monkeypatch.delattr(torch.cpu, name, raising=False)
        flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
        assert precision._cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    finally:
        monkeypatch.undo()
        precision._cpu_has_bf16.cache_clear()


@pytest.mark.parametrize("dtype,weights,want", [
    (None, "auto", (torch.float32, "dense")),        # the library's default: as before
    ("bfloat16", "auto", (torch.bfloat16, "file")),
    ("float16", "auto", (torch.float16, "dense")),   # the CPU int4 kernel is fast in bfloat16 only
    (None, "fp32", (torch.float32, "dense")),
    ("auto", "bf16", (torch.bfloat16, "dense")),
    ("float32", "int4", (torch.float32, "int4")),
    (torch.bfloat16, "INT8", (torch.bfloat16, "int8")),
])
def test_resolve_precision(dtype, weights, want):
    assert loading.resolve_precision(dtype, weights, "cpu") == want


@pytest.mark.parametrize("dtype,weights,needle", [
    ("float32", "bf16", "compute dtype"), ("float64", "auto", "dtype"), ("auto", "int3", "weights"),
])
def test_resolve_precision_refuses(dtype, weights, needle):
    with pytest.raises(UserError, match=needle):
        loading.resolve_precision(dtype, weights, "cpu")


def test_cli_refuses_unknown_weights_before_loading(cli, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("loaded before checking --weights"))
    code, out, err = cli("generate", "--model", tiny_checkpoint, "-p", "It is", "--weights", "int3")
    assert code == 2 and err.count("\n") == 1 and "--weights" in err and "int3" in err


# ---- whole models ---------------------------------------------------------------------------------------
def _prefill(model, tokens):
    sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1])
    return runtime.prefill(model, tokens, sess, all_logits=True)


def _dense_twin(quantized, dense):
    """`dense` with each quantized module's dequantized weights copied in: the same numbers in nn.Linear (a
    joined projection's weights are its parts', copied from them)."""
    with torch.no_grad():
        for name, mod in quantized.named_modules():
            if isinstance(mod, (Int4Linear, Int8Linear, Int8Embedding)) and not getattr(mod, "joins", ()):
                dense.get_submodule(name).weight.copy_(mod.dequantize(torch.float32))
    return dense


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_checkpoint_runs_its_dequantized_weights(tiny_checkpoint, mode):
    """A dense checkpoint re-quantized: every projection and the tied table are swapped, and the model
    computes what a dense model holding the dequantized weights computes (float32: summation order)."""
    q, tok, _ = load(tiny_checkpoint, dtype="float32", weights=mode, progress=False)
    kinds = q.weights_info.kinds
    assert [kinds[f"layers.{i}.{p}"] for i in range(2) for p in loading.PROJECTIONS] == [mode] * 14
    assert kinds["embed_tokens"] == kinds["lm_head"] == "int8" and not q.weights_info.fallbacks
    assert isinstance(q.embed_tokens, Int8Embedding) and q.lm_head.qweight is q.embed_tokens.qweight
    dense, _, _ = load(tiny_checkpoint, dtype="float32", weights="fp32", progress=False)
    assert parameter_count(q) == parameter_count(dense)
    assert weight_bytes(q) < weight_bytes(dense) / 2.5
    twin = _dense_twin(q, dense)
    tokens = torch.randint(3, len(tok), (2, 9), generator=torch.Generator().manual_seed(3))
    got, want = _prefill(q, tokens), _prefill(twin, tokens)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_bfloat16_quantized_model_is_quantized_from_float32_and_all_bfloat16(tmp_path):
    """Codes come from the checkpoint's float32 weights (not from weights rounded to bfloat16 first);
    every other floating parameter (norms, biases) ends up in bfloat16, so no float32 leaks into a layer."""
    tok = make_tokenizer()
    hf, _ = build_tiny("llama", attention_bias=True, vocab_size=len(tok))
    folder = tmp_path / "biased"
    hf.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    q, _, _ = load(folder, dtype="bfloat16", weights="int4", progress=False)
    ref = Int4Linear.quantize(hf.model.layers[1].self_attn.k_proj.weight, 32, torch.bfloat16)
    assert torch.equal(q.layers[1].attn.k_proj.codes(), ref.codes())
    assert torch.equal(q.layers[1].attn.k_proj.scale_zero, ref.scale_zero)
    floats = [(n, p.dtype) for n, p in q.named_parameters() if p.is_floating_point()]
    assert floats and all(dt == torch.bfloat16 for _, dt in floats), floats
    assert q.layers[0].attn.q_proj.bias is not None
    logits = _prefill(q, torch.tensor([[5, 9, 30]]))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_fallback_for_shapes_the_kernel_cannot_take(tmp_path, cli):
    """One KV head of dim 8: k/v projections have 8 output rows, which the CPU int4 kernel's packing
    refuses (multiples of 16): they run in int8, with the reason, and the CLI names them."""
    tok = make_tokenizer()
    hf, _ = build_tiny("llama", num_key_value_heads=1, vocab_size=len(tok))
    folder = tmp_path / "one-kv-head"
    hf.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    q, _, _ = load(folder, dtype="bfloat16", weights="int4", progress=False)
    fell = {name: (kind, why) for name, kind, why in q.weights_info.fallbacks}
    assert set(fell) == {f"layers.{i}.attn.{p}_proj" for i in range(2) for p in "kv"}
    assert all(kind == "int8" and "multiple of 16" in why for kind, why in fell.values())
    assert isinstance(q.layers[0].attn.k_proj, Int8Linear) and isinstance(q.layers[0].attn.q_proj, Int4Linear)
    dense, _, _ = load(folder, dtype="float32", weights="fp32", progress=False)
    twin = _dense_twin(q, dense)
    tokens = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(4))
    got, want = _prefill(q, tokens), _prefill(twin, tokens)
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()  # bfloat16 activations
    code, out, err = cli("generate", "--model", folder, "-p", "It is", "-n", "2",
                         "--weights", "int4", "--dtype", "bfloat16")
    assert code == 0 and "4 weights not in the asked format" in err and "layers.0.attn.k_proj as int8" in err


def test_weight_streaming_moves_quantized_weights(tiny_checkpoint):
    from infinigen.placement.weights import WeightStreamer
    q, tok, _ = load(tiny_checkpoint, dtype="bfloat16", weights="int4", progress=False)
    tokens = torch.randint(3, len(tok), (1, 8), generator=torch.Generator().manual_seed(2))
    want = _prefill(q, tokens)
    with WeightStreamer(q, fraction=0.5, threaded=False) as ws:
        got = _prefill(q, tokens)
        assert ws.slow_bytes > 0 and ws.bytes_moved > 0
    assert torch.equal(got, want)


# ---- the default model (its own GGUF) -------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_int4():
    model, tok, _ = load("default", dtype="bfloat16", weights="auto", progress=False)
    return model, tok


def _gguf_tensor_bytes() -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(loading.default_gguf()).tensors)


@pytest.mark.integration
def test_default_model_keeps_the_files_weights(default_int4, default_model):
    """Every Q4_1 projection comes from the file's blocks as int4 and dequantizes (float32 scales) to
    exactly the weights of the dequantized runtime, q/k rows in its order; the Q8_0 table is int8 within
    half a row step; the weights take at most 1.2x the GGUF's tensor bytes."""
    q, _ = default_int4
    dense, _ = default_model
    info = q.weights_info
    assert info.counts() == {"int4": 210, "int8": 2} and not info.fallbacks and len(info.from_file) == 212
    folder = loading._convert_gguf(loading.default_gguf(), progress=False)
    types, cached = loading._gguf_blocks(loading.default_gguf(), folder, dense.cfg)
    fresh_types, fresh = loading._read_gguf_blocks(loading.default_gguf(), dense.cfg)  # the cache = the file
    assert types == fresh_types and cached.keys() == fresh.keys()
    assert all(torch.equal(cached[k], fresh[k]) for k in fresh)
    exact, _, _ = load("default", dtype="float32", weights="int4", progress=False)
    for name, kind in exact.weights_info.kinds.items():
        if kind == "int4":
            dequantized = exact.get_submodule(name).dequantize(torch.float32)
            assert torch.equal(dequantized, dense.get_submodule(name).weight), name
    table = q.embed_tokens.dequantize(torch.float32)
    step = q.embed_tokens.scales.float()[:, None]
    assert ((table - dense.embed_tokens.weight).abs() <= step / 2 + 1e-6).all()
    assert weight_bytes(q) <= 1.2 * _gguf_tensor_bytes()


@pytest.mark.integration
def test_default_model_int4_layers_reproduce_the_dense_ones(default_int4, default_model):
    """Real layers, real inputs (hidden states of a prompt): the int4 projection in bfloat16 gives the
    float32 dense projection of the dequantized weights within bfloat16 rounding (scales, inputs, output)."""
    q, tok = default_int4
    dense, _ = default_model
    ids = torch.tensor([tok("It is a truth universally acknowledged, that a single man")["input_ids"]])
    captured = {}
    def capture(kind, i):
        return lambda m, a: captured.__setitem__((kind, i), a[0][0])
    hooks = [dense.layers[i].attn.q_proj.register_forward_pre_hook(capture("attn", i)) for i in (0, 15, 29)]
    hooks += [dense.layers[i].mlp.down_proj.register_forward_pre_hook(capture("mlp", i)) for i in (0, 15, 29)]
    _prefill(dense, ids)
    for h in hooks:
        h.remove()
    for (part, i), x in captured.items():
        names = ["q_proj", "k_proj", "v_proj"] if part == "attn" else ["down_proj"]
        for proj in names:
            qm, dm = getattr(getattr(q.layers[i], part), proj), getattr(getattr(dense.layers[i], part), proj)
            for rows in (x[-1:], x.repeat(6, 1)):  # one row (the kernel); 6 x the prompt (dequantize + dense)
                y = qm(rows.bfloat16()).double()
                ref = rows.double() @ dm.weight.double().T
                assert ((y - ref).abs() <= scale_rounding_bound(qm, rows)).all(), (part, i, proj, rows.shape)


def scale_rounding_bound(m: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """How far a bfloat16 int4 projection may be from the float32 product with the file's weights: the
    scale d and zero m + 8d rounded to bfloat16 (2^-9 of each: |code - 8| 2^-9 d + 2^-9 |zero| per
    weight), the input, the weights of the dense path and the output rounded once each (2^-9 of
    sum |x| |w| each), with 1% slack for second-order terms."""
    g = m.group
    codes = m.codes().double()
    sz = m.scale_zero.double()
    scale, zero = sz[..., 0].T.repeat_interleave(g, 1), sz[..., 1].T.repeat_interleave(g, 1)
    w = (codes - 8) * scale + zero
    per_weight = 2.0 ** -9 * ((codes - 8).abs() * scale + zero.abs())
    ax = x.double().abs()
    return 1.01 * (ax @ per_weight.T + 3 * 2.0 ** -9 * (ax @ w.abs().T)) + 1e-6


@pytest.mark.integration
def test_default_model_answers_in_int4(default_int4):
    from infinigen.generate import generate
    q, tok = default_int4
    g = generate(q, tok, ["What is the capital of France?"], max_new_tokens=12, chat=True)
    assert "Paris" in g.texts[0]
