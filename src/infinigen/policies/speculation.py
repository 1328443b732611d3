"""InfiniGen's speculation keys: what a layer's selection is scored against, and how.

Three things, kept per request on `InfiniGenState` (policies/infinigen.py) and built here:
  * the skew matrices A [L, Hkv, d, d] (`infinigen.skew`): a model-wide resource, loaded or calibrated once per
    (model, calibration text) and shared by every policy object and session on that model (`prepare_skew`);
  * the speculation keys of every cached token: the partial columns K~[:, idx] in the model's dtype (the paper,
    key_mode "partial") or all skewed columns packed in 4 bits (`kernels.int4.PackedKeys`, key_mode "int4"),
    written at prefill and kept up to date on every append, so they follow pool evictions;
  * the scorer: a query row, projected as the keys were, against the first n keys (`SpeculationKeys.scores`).

Everything the speculation multiplies is computed in float64 and rounded to float32 once: the vectorized
(teacher-forced) and the row-by-row (decoding) paths then agree to the last bit whatever the matmul shapes. The
operands are small (a token's key, a step's query: [B, Hkv, G, d] against d x d or d x cols), so float64 costs
microseconds per layer next to the scoring.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..kernels import fused_select
from ..kernels.int4 import PackedKeys, tinygemm_ok

INT4_GROUP = 32
PADDED_FROM = 512  # the capacity from which the 4-bit keys take the int4 kernel's layout whatever its padding

# Skew matrices per model and calibration text (None: the cached or default one), loaded or computed once by
# `prepare_skew`, shared by every policy object and session on that model.
_SKEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def fake_int4(x: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Group-wise asymmetric 4-bit quantize-dequantize along the last dim (per token, groups of `group`)."""
    d = x.shape[-1]
    if d % group:
        group = d
    g = x.reshape(*x.shape[:-1], d // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(x.shape)


def int4_layout(d: int, capacity: int, device) -> str:
    """The `PackedKeys` layout of a request's 4-bit speculation keys, chosen once in `begin` so that decoding
    and teacher-forced scoring quantize the same way: torch's CPU int4 kernel where it takes this head_dim and padding
    the capacity to its 64-token blocks keeps the bytes within 2.4% (40 B/token/head then stays under 8% of
    float32 K+V) or the capacity holds at least `PADDED_FROM` slots (its at most 63 padded slots then cost under 2%
    of 16-bit K+V: a chat of 512 tokens and its answer is scored natively), else the portable rows layout, whose
    torch scorer is several times slower on a CPU and dispatches thousands of operators per step."""
    padded = -(-capacity // 64) * 64
    fits = padded <= 1.024 * capacity or capacity >= PADDED_FROM
    return "tinygemm" if tinygemm_ok(d, INT4_GROUP, device) and fits else "rows"


# ---- skew matrices ------------------------------------------------------------------------------------------
def needs_skew(policy, model) -> bool:
    """Whether `policy` rotates with skew matrices on `model`: skew on, and the weights do not already produce
    q~ and k~ (`skew.skew_model`)."""
    return bool(policy.skew) and getattr(model, "skew_folded", None) is None


def prepare_skew(policy, model, tokenizer=None, progress=False) -> None:
    """Make the model's skew matrices ready for `policy`: those of `infinigen skew` (or of an earlier `prepare`)
    from the cache, else calibrated on `policy.calib` (default: a bundled novel) with `tokenizer` and cached."""
    if not needs_skew(policy, model) or policy.matrices is not None:
        return
    cached = _SKEWS.setdefault(model, {})
    if policy.calib in cached:
        return
    from ..skew import find_cached_skew, load_or_compute_skew
    skew = find_cached_skew(model) if policy.calib is None else None
    if skew is None:
        if tokenizer is None:
            raise UserError("InfiniGen needs this model's skew matrices: run `infinigen skew` once, or give "
                            "prepare() the tokenizer to calibrate them (or set the knob skew=false)")
        skew = load_or_compute_skew(model, tokenizer, policy.calib, progress=progress)
    cached[policy.calib] = skew


def skew_in_use(policy, model):
    """The `skew.Skew` (or bare tensor) `policy` rotates with on `model`, None when it rotates with none or
    none is loaded yet."""
    if policy.matrices is not None:
        return policy.matrices
    return _SKEWS.get(model, {}).get(policy.calib) if needs_skew(policy, model) else None


def skew_matrices(policy, model) -> torch.Tensor | None:
    """The skew matrices [L, Hkv, d, d] float64 on the model's device (None: no rotation)."""
    if not needs_skew(policy, model):
        return None
    m = policy.matrices
    if m is None:
        m = _SKEWS.get(model, {}).get(policy.calib)
        if m is None:
            prepare_skew(policy, model)  # the cached artifact, or a clear error
            m = _SKEWS[model][policy.calib]
    m = getattr(m, "matrices", m)
    cfg = model.cfg
    if tuple(m.shape) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim):
        raise UserError(f"skew matrices of shape {tuple(m.shape)} do not fit this model")
    return m.to(device=model.device, dtype=torch.float64)


def layer_sparsity(policy, model) -> list[float] | None:
    """The calibrated attention sparsity per layer of the skew in use (None: uniform layer caps; an
    artifact of format 1, matrices given as a bare tensor, or skew off)."""
    m = policy.matrices
    if m is None and needs_skew(policy, model):
        m = _SKEWS.get(model, {}).get(policy.calib)
    if m is None:
        m = getattr(model, "skew_folded", None)
    sp = getattr(m, "sparsity", None)
    if sp is None or len(sp) != model.cfg.num_layers:
        return None
    return sp.tolist() if isinstance(sp, torch.Tensor) else [float(x) for x in sp]  # (a tensor's in one call)


# ---- keys and scorer ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculationKeys:
    """How a request's speculation keys are built, kept and scored, for the knobs `key_mode` ("partial": the
    paper's partial columns; "int4": every skewed column in 4 bits) and `key_centre` (int4: pack each key less
    the layer's mean key). Stateless: what it builds lives on the request's state `st`."""
    key_mode: str
    key_centre: bool = False

    @staticmethod
    def rotate(st, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [B, Hkv, ..., d] -> x A[layer, kv head] in float32."""
        x = x.to(torch.float64)
        if st.A is None:
            return x.float()
        # one bmm per KV head over every row: broadcasting A over [B, ..., G] would copy it per row
        # (measured at B 8, G 3, d 64: 0.2 ms against 1.3 ms per layer and step, on a loaded 2-core CPU;
        # float32 would save another 0.09 ms but could round differently for other row counts)
        b, h, d = x.shape[0], x.shape[1], x.shape[-1]
        y = torch.bmm(x.reshape(b, h, -1, d).transpose(0, 1).reshape(h, -1, d), st.A[layer])
        return y.view(h, b, -1, d).transpose(0, 1).reshape(x.shape).float()

    def project(self, st, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [B, Hkv, ..., d] -> what speculation multiplies, float32: all skewed columns (int4), or the
        partial ones: x @ A[layer][:, idx] with the precomputed partial weights (one d x cols matmul
        instead of a d x d rotation and a gather). For the Llama family RoPE sits between W_Q and A, so
        the partial weights apply to the post-RoPE query: W_Q itself cannot be sliced exactly. A model with
        the skew folded into W_Q and W_K (`skew.skew_model`, OPT) has no A: its query columns are gathered.
        Slicing its W_Q~ instead would need a copy per request row (the index is per row and KV head):
        [B, H, hidden, cols] in the model's dtype, at OPT-6.7B and batch 8 some 80 MB per layer, 30% of
        a 2048-token KV cache, to save a projection that costs one hidden x d matmul per step."""
        if self.key_mode == "int4":
            return self.rotate(st, x, layer)
        w = st.proj.get(layer)
        if w is None:
            idx = st.idx[layer]
            idx = idx.view(*idx.shape[:2], *([1] * (x.dim() - 3)), idx.shape[-1])
            return x.gather(-1, idx.expand(*x.shape[:-1], idx.shape[-1])).float()
        y = x.reshape(*x.shape[:2], -1, x.shape[-1]).to(torch.float64) @ w.to(torch.float64)  # [B, Hkv] batches
        return y.view(*x.shape[:-1], w.shape[-1]).float()

    def centre(self, st, layer: int, keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """key_centre: rotated keys [B, Hkv, T, d] less the layer's mean key, first set from the `valid` ones
        [B, Hkv, T] when given; without key_centre the keys as they are."""
        if not self.key_centre:
            return keys
        if valid is not None:
            w = valid[..., None].float()
            st.key_mean[layer] = (keys * w).sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1)
        return keys - st.key_mean[layer]

    def shifted(self, st, layer: int, scores: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
        """Scores [B, Hkv, R, n] of queries qs [B, Hkv, R, d] against centred keys plus q . mean key: the
        scores of the keys themselves (what the remainder's mass needs)."""
        if not self.key_centre:
            return scores
        return scores + (qs * st.key_mean[layer]).sum(-1, keepdim=True)

    def packed(self, st, layer: int, k: torch.Tensor, capacity: int, valid: torch.Tensor | None) -> PackedKeys:
        """Keys k [B, Hkv, T, d] rotated (centred on the `valid` ones) and packed in 4 bits into `capacity` slots."""
        b, hkv, _, d = k.shape
        keys = PackedKeys(b, hkv, capacity, d, group=INT4_GROUP, layout=st.layout, device=k.device)
        if self.native(keys):  # rotated and packed in one native call: the bytes of the torch path
            keys.write_rotated(0, k, self.rotation(st, layer))
            return keys
        keys.write(0, self.centre(st, layer, self.rotate(st, k, layer), valid))
        return keys

    def write_prompt(self, st, layer: int, q: torch.Tensor, k: torch.Tensor, store) -> None:
        """The speculation keys of a prompt's keys k [B, Hkv, T, d] (and, for the partial columns, the columns
        chosen by the prompt's queries q [B, H, T, d] and keys, and the partial weights)."""
        b, h, t, d = q.shape
        hkv = k.shape[1]
        if self.key_mode == "int4":
            st.spec_keys[layer] = self.packed(st, layer, k, store.capacity, store.valid[layer][:, :, :k.shape[2]])
            return
        w = store.valid[layer][:, :, :t, None].float()  # pad tokens of left-padded prompts do not vote
        qs = self.rotate(st, q.view(b, hkv, h // hkv, t, d), layer).abs()
        ks = self.rotate(st, k, layer)
        colsum = (qs * w[:, :, None]).sum((2, 3)) + (ks.abs() * w).sum(2)  # [B, Hkv, d]
        idx = colsum.topk(st.cols, dim=-1).indices.sort(-1).values
        st.idx[layer] = idx
        if st.A is not None:  # the partial weights: the skew's columns idx, per (row, KV head)
            a = st.A[layer].expand(b, hkv, d, d)
            # kept in the model's dtype, like W_Q (float32 would add cols/capacity of the KV bytes)
            st.proj[layer] = a.gather(-1, idx[:, :, None, :].expand(b, hkv, d, st.cols)).to(st.key_dtype)
        spec_keys = torch.zeros(b, hkv, store.capacity, st.cols, dtype=st.key_dtype, device=k.device)
        spec_keys[:, :, :t] = self.project(st, k, layer).to(st.key_dtype)
        st.spec_keys[layer] = spec_keys

    def native(self, spec_keys) -> bool:
        """Whether a decoding row's query and key are rotated inside the native scorer and append
        (`PackedKeys.scores_rotated`, `scatter_rotated`): 4-bit keys in the int4 kernel's layout, not centred,
        the kernel built. The same float64 products rounded to float32 once as `rotate`, without its torch calls."""
        return self.key_mode == "int4" and not self.key_centre and isinstance(spec_keys, PackedKeys) and \
            spec_keys.rotates()

    @staticmethod
    def rotation(st, layer: int) -> torch.Tensor | None:
        """The skew matrices [Hkv, d, d] float64 of `layer` (None: no rotation), views made once per request."""
        if st.A is None:
            return None
        if not st.rotations:
            st.rotations = st.A.unbind(0)
        return st.rotations[layer]

    def append(self, st, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """The current token's key k [B, Hkv, 1, d] written into `slots` [B, Hkv] of the layer's keys."""
        spec_keys = st.spec_keys[layer]
        if self.native(spec_keys):
            spec_keys.scatter_rotated(slots, k, self.rotation(st, layer))
            return
        if self.key_mode == "int4":
            spec_keys.scatter(slots, self.centre(st, layer, self.rotate(st, k, layer)))
            return
        rows = self.project(st, k, layer).to(st.key_dtype)  # [B, Hkv, 1, cols]
        idx = slots[:, :, None, None].expand(*slots.shape, 1, spec_keys.shape[-1])
        if spec_keys.element_size() == 2:  # 16-bit floats moved as int16: scatter_ on them is slow in torch 2.13
            spec_keys, rows = spec_keys.view(torch.int16), rows.view(torch.int16)
        spec_keys.scatter_(2, idx, rows)

    def keys(self, st, layer: int, session):
        """The keys speculation scores `layer` against; with `lazy_keys`, packed from the store's keys the
        first time (the same rotation and packing per token as a prefill's and an append's)."""
        keys = st.spec_keys.get(layer)
        if keys is None and st.lazy_keys:
            k, _, valid, _ = session.store.past(layer)
            keys = self.packed(st, layer, k, session.store.capacity, valid)
            st.spec_keys[layer] = keys
        return keys

    @staticmethod
    def _query(st, layer: int) -> torch.Tensor:
        """The post-RoPE queries [B, Hkv, G, T, d] speculation scores `layer` with."""
        qs = st.spec.get(layer)
        if qs is None and layer in st.spec_rows:  # the layer's own query, one row
            return st.spec_rows[layer].unsqueeze(3)
        if qs is None:
            raise RuntimeError(f"no speculation for layer {layer} (the hook of layer {layer - 1} did not run)")
        return qs

    @staticmethod
    def row_query(st, layer: int, row: int) -> torch.Tensor:
        """The post-RoPE query [B, Hkv, G, d] of decoding row `row` that speculation scores `layer` with."""
        if row == 0 and layer not in st.spec and layer in st.spec_rows:
            return st.spec_rows[layer]
        return SpeculationKeys._query(st, layer).select(3, row)

    def queries(self, st, layer: int, rows: slice) -> torch.Tensor:
        """Projected speculative queries [B, Hkv, G, R, c] (float32) of decoding rows `rows`."""
        return self.project(st, self._query(st, layer)[:, :, :, rows], layer)

    def scores(self, st, layer: int, row: int, spec_keys, n: int) -> torch.Tensor:
        """Speculated scores [B, Hkv, G, n] (float32) of decoding row `row` against the first n slots of
        the partial or packed keys, the same calls on both paths (decoding and `sequence_rows`), so they
        agree bit for bit. int4: torch's int4 kernel or the tiled scorer read the packed codes (no float
        copy of the context). partial: one matmul per row in the keys' 16-bit dtype; the G query heads
        are the matmul rows (broadcasting the keys over G copied them G times)."""
        if self.native(spec_keys):  # the row's query rotated inside the scorer
            return spec_keys.scores_rotated(self.row_query(st, layer, row), self.rotation(st, layer), n)
        qs = self.queries(st, layer, slice(row, row + 1))[:, :, :, 0].contiguous()  # [B, Hkv, G, c]
        if isinstance(spec_keys, PackedKeys):
            return self.shifted(st, layer, spec_keys.scores(qs, n), qs)
        k = spec_keys[:, :, :n]
        return (qs.to(k.dtype) @ k.transpose(-1, -2)).float()

    def scores_cut(self, st, layer: int, row: int, spec_keys, n: int, **cut):
        """`scores` of decoding row `row` and InfiniGen's layer cut of them (`cut`: scale, alpha, total, capacity,
        with_lse) in one native call, where the row's query is rotated inside the native scorer (`native`): what
        `fused_select.select_packed` returns, else None (the caller scores, then cuts)."""
        if not (fused_select.scores_with_selection and self.native(spec_keys)):
            return None
        return spec_keys.select_rotated(self.row_query(st, layer, row), self.rotation(st, layer), n, **cut)
