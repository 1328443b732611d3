"""The fused selecting attention (`kernels/fused_select`: one C++ call over the rows `KVStore.select_rows`
packs) against the torch path it replaces (`gather_rows` + the head mask + `attend_masked`, the remainder
from a log-sum-exp over the gathered rows): the same outputs, log-sum-exps and value sums on random shapes,
and in a decoding session the same selections and logits; the checks fail when a row is dropped, the cap
is wrong or the remainder is applied from a stale log-sum-exp; without a build the torch path serves."""
from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest
import torch

from infinigen import runtime
from infinigen.runtime import attention
from infinigen.cache import KVStore
from infinigen.kernels import fused_select
from infinigen.paths import writable_cache
from support.packed_rows import decode_rows, packed_policy, padded_prompts
from support.native import assert_failed_build_warns_once

needs_kernel = pytest.mark.skipif(not fused_select.available(), reason="the fused kernel cannot be built here")


def _store(b, hkv, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    store = KVStore(1, b, hkv, s + 5, d, dtype)
    k = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, generator=g).to(dtype)
    valid = torch.rand(b, s, generator=g) > 0.1
    store.write_prompt(0, k, v, valid, torch.arange(s).expand(b, s))
    return store, g


def _reference(store, sel, q, slots, scale):
    """The torch path of a session reading packed rows: out [B,H,1,d], lse [B,Hkv,G], the past values' sum."""
    b, h, _, d = q.shape
    hkv = sel.counts.shape[1]
    rows, head = attention.with_own(sel, slots, store.capacity)
    kp, vp = store.gather_rows(0, rows, *attention.StepBuffers().rows(rows.numel(), store.k[0]))
    mask = attention.head_mask(head, h, hkv)
    out = runtime.attend_masked(q, kp, vp, mask, scale)
    scores = (q.view(b, 1, h, d).float() @ kp.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1).view(b, hkv, h // hkv)
    past = head[:, :-hkv]
    sums = torch.stack([torch.stack([(vp[i, 0, :-hkv].float() * (past[i] == j)[:, None]).sum(0)
                                     for j in range(hkv)]) for i in range(b)])
    return out, lse, sums


def _case(b, hkv, g, d, s, ratio, dtype, seed, empty_head=False, one_row=False):
    store, gen = _store(b, hkv, s, d, dtype, seed)
    keep = torch.rand(b, hkv, s, generator=gen) < ratio
    if empty_head:
        keep[0, 0] = False  # a (batch row, KV head) reading only its own token
    if one_row:
        keep[-1, -1] = False
        keep[-1, -1, s // 2] = True
    sel = store.select_rows(0, keep, store.valid[0][:, :, :s])
    q = torch.randn(b, hkv * g, 1, d, generator=gen).to(dtype)
    k1 = torch.randn(b, hkv, 1, d, generator=gen).to(dtype)
    slots = store.append(0, k1, k1 * 0.5, torch.full((b,), s))  # the current token, stored first
    own = torch.arange(b * hkv).view(b, hkv) * store.capacity + slots
    return store, sel, q, slots, own


SHAPES = [(1, 3, 3, 64, 517, 0.1), (3, 2, 4, 16, 33, 0.5), (2, 1, 1, 8, 1, 1.0), (4, 3, 3, 64, 200, 0.02),
          (2, 4, 2, 32, 77, 1.0), (1, 2, 8, 64, 1000, 0.3)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s[:5])) for s in SHAPES])
@pytest.mark.parametrize("empty_head,one_row", [(False, False), (True, True)])
def test_kernel_equals_the_torch_path_float32(shape, empty_head, one_row):
    """Random GQA shapes and odd lengths, every row padded differently; a head that reads only its own
    token and one that reads one past row: output, log-sum-exp and the past values' sum within 1e-5."""
    b, hkv, g, d, s, ratio = shape
    store, sel, q, slots, own = _case(b, hkv, g, d, s, ratio, torch.float32, seed=s,
                                      empty_head=empty_head, one_row=one_row)
    ref, lse_ref, sums_ref = _reference(store, sel, q, slots, d ** -0.5)
    out, lse, sums = fused_select.attend_rows(q.view(b, hkv * g, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                              sel.rows, sel.counts, own, d ** -0.5)
    assert (out.view_as(ref) - ref).abs().max() <= 1e-5
    assert (lse.view_as(lse_ref) - lse_ref).abs().max() <= 1e-5
    assert (sums - sums_ref).abs().max() <= 1e-4 * max(1.0, float(sums_ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_16_bits_within_rounding(dtype):
    """16-bit stores: read as float32, accumulated in float32, rounded once (the torch path rounds more)."""
    b, hkv, g, d, s = 2, 3, 3, 64, 300
    store, sel, q, slots, own = _case(b, hkv, g, d, s, 0.2, dtype, seed=7)
    ref, lse_ref, _ = _reference(store, sel, q, slots, d ** -0.5)
    out, lse, _ = fused_select.attend_rows(q.view(b, -1, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                           sel.rows, sel.counts, own, d ** -0.5)
    assert out.dtype == dtype
    assert (out.view_as(ref).float() - ref.float()).abs().max() <= 2e-2
    assert (lse.view_as(lse_ref) - lse_ref).abs().max() <= 2e-2


@needs_kernel
def test_nothing_read_gives_zero_and_minus_infinity():
    """No rows and no own token: a zero output and a log-sum-exp of -inf (a remainder weight of 1)."""
    keys = torch.randn(10, 8)
    out, lse, sums = fused_select.attend_rows(torch.randn(2, 4, 8), keys, keys, torch.zeros(2, 0, dtype=torch.long),
                                              torch.zeros(2, 2, dtype=torch.long), None, 1.0)
    assert torch.equal(out, torch.zeros(2, 4, 8)) and torch.equal(sums, torch.zeros(2, 2, 8))
    assert torch.isneginf(lse).all()


@needs_kernel
def test_bad_indices_are_refused_before_the_work():
    keys = torch.randn(10, 8)
    q = torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="row out of range"):
        fused_select.attend_rows(q, keys, keys, torch.tensor([[3, 10]]), torch.tensor([[2]]), None, 1.0)
    with pytest.raises(RuntimeError, match="counts exceed"):
        fused_select.attend_rows(q, keys, keys, torch.tensor([[3, 4]]), torch.tensor([[3]]), None, 1.0)


@needs_kernel
@pytest.mark.parametrize("breakage", ["drop a row", "wrong cap", "stale lse", "sums without the run"])
def test_a_broken_kernel_call_is_caught(breakage):
    """The comparison above has teeth: a row dropped from a run, a run cut short (a wrong cap), the
    log-sum-exp of another step, or the value sums of another selection each differ from the torch path."""
    b, hkv, g, d, s = 2, 3, 3, 64, 300
    store, sel, q, slots, own = _case(b, hkv, g, d, s, 0.2, torch.float32, seed=3)
    ref, lse_ref, sums_ref = _reference(store, sel, q, slots, d ** -0.5)
    rows, counts, qq = sel.rows, sel.counts, q
    if breakage == "drop a row":
        rows = rows.clone()
        rows[0, 0] = rows[0, 1]  # the first row read twice, the first read never
    elif breakage == "wrong cap":
        counts = counts.clone()
        counts[1, 2] -= 1
    elif breakage == "stale lse":
        qq = torch.randn_like(q)
    elif breakage == "sums without the run":
        counts = counts.clone()
        counts[0, 0] = 0
    out, lse, sums = fused_select.attend_rows(qq.view(b, -1, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                              rows, counts, own, d ** -0.5)
    errors = [(out.view_as(ref) - ref).abs().max(), (lse.view_as(lse_ref) - lse_ref).abs().max(),
              (sums - sums_ref).abs().max()]
    assert max(errors) > 1e-3


# ---- in a decoding session ------------------------------------------------------------------------
REST = dict(remainder=True, remainder_from=0, max_fetch_ratio=0.3, min_fetch=0)  # entries left unread, added back
CASES = [("infinigen", {}), ("infinigen", dict(budget="union", alpha=1.0)),
         ("infinigen", dict(budget="layer", max_fetch_ratio=0.1)), ("oracle", dict(ratio=0.3)), ("infinigen", REST)]


def _decode_with(model, name, knobs, fused, monkeypatch):
    monkeypatch.setattr(fused_select, "enabled", fused)
    tokens, mask = padded_prompts(model, (9, 4, 6))
    return decode_rows(model, packed_policy(name, model, **knobs), tokens, mask, read_rows=True)


@needs_kernel
@pytest.mark.parametrize("name,knobs", CASES, ids=["infinigen", "union", "cap-0.1", "oracle", "remainder"])
def test_session_fused_equals_the_torch_path(make_tiny, monkeypatch, name, knobs):
    """float32, GQA (8 query heads over 2 KV heads), 3 rows of different prompt lengths: the fused path is
    taken, selects what the torch path selects at every layer and step, and its logits are within 1e-5."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    ref, seen_ref, _ = _decode_with(model, name, knobs, False, monkeypatch)
    calls = [0]
    inner = fused_select.attend_rows

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(fused_select, "attend_rows", counted)
    out, seen, _ = _decode_with(model, name, knobs, True, monkeypatch)
    assert calls[0] > 0
    assert seen.keys() == seen_ref.keys()
    for key in seen:
        assert (seen[key] == "all" and seen_ref[key] == "all") or torch.equal(seen[key], seen_ref[key]), key
    assert (out - ref).abs().max() <= 1e-5


@needs_kernel
@pytest.mark.parametrize("breakage", ["drop a row", "stale remainder"])
def test_session_check_catches_a_broken_fused_path(make_tiny, monkeypatch, breakage):
    """The session comparison fails when the fused path drops a selected row or mixes in the remainder of the
    previous call (its unread log-mass)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    ref, _, _ = _decode_with(model, "infinigen", REST, False, monkeypatch)
    inner, last = fused_select.attend_rows, {}

    def broken(q, keys, values, rows, counts, own, scale, remainder=None):
        if breakage == "drop a row":
            counts = counts.clone()
            counts[counts > 0] -= 1
            return inner(q, keys, values, rows, counts, own, scale, remainder=remainder)
        if remainder is None:  # a layer reading all (layer 0)
            return inner(q, keys, values, rows, counts, own, scale)
        stale = last.get(remainder.lse.shape, remainder.lse)
        last[remainder.lse.shape] = remainder.lse
        return inner(q, keys, values, rows, counts, own, scale, remainder=remainder._replace(lse=stale))
    monkeypatch.setattr(fused_select, "attend_rows", broken)
    out, _, _ = _decode_with(model, "infinigen", REST, True, monkeypatch)
    assert (out - ref).abs().max() > 1e-4


def test_without_a_build_the_torch_path_serves(make_tiny, monkeypatch):
    """The kernel unavailable: `usable` is False, the session takes the torch path and decodes the same."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    monkeypatch.setattr(fused_select, "_module", lambda: None)
    assert not fused_select.available()
    assert not fused_select.usable(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    called = []
    monkeypatch.setattr(fused_select, "attend_rows", lambda *a: called.append(1))
    out, _, _ = _decode_with(model, "infinigen", {}, True, monkeypatch)
    assert not called and torch.isfinite(out).all()


def test_a_failed_build_warns_in_one_line(tmp_path):
    """No compiler: one warning line on stderr, `available()` False, nothing raised."""
    assert_failed_build_warns_once("fused_select", tmp_path)


@needs_kernel
def test_a_build_killed_mid_way_does_not_hold_back_the_next_run(tmp_path):
    """cpp_extension's `lock` file left by a builder that was killed (Ctrl-C on a first run) makes every later
    build wait for it forever; the next run, holding the build's own lock (dropped when its holder dies),
    removes it and loads the kernel."""
    import os
    import shutil
    cache = tmp_path / "cache"
    src = writable_cache(f"kernels/fused_select-{fused_select.build_key()}")  # built (needs_kernel)
    dst = cache / "kernels" / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (dst / "lock").write_text("")  # as a killed build leaves it
    code = "from infinigen.kernels import fused_select as f\nprint(f.available())\n"
    env = dict(os.environ, INFINIGEN_CACHE=str(cache), PYTHONPATH=":".join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert not (dst / "lock").exists()


@needs_kernel
def test_a_checkout_elsewhere_loads_the_built_kernel_without_building(tmp_path):
    """Checkouts at different paths share one build folder (keyed by the source's bytes); the build compiles the
    source's copy inside that folder, so another checkout's source path does not make it build again (a build
    inside a memory-bounded run can be killed): the built library is not written again."""
    import os
    import shutil
    package = Path(fused_select.__file__).parents[1]
    elsewhere = tmp_path / "elsewhere" / "src"
    shutil.copytree(package, elsewhere / "infinigen", ignore=shutil.ignore_patterns("__pycache__"))
    build = writable_cache(f"kernels/fused_select-{fused_select.build_key()}")  # built (needs_kernel)
    (library,) = build.glob("*.so")
    before = library.stat().st_mtime_ns
    code = "from infinigen.kernels import fused_select as f\nprint(f.available(), f.__file__)\n"
    env = dict(os.environ, PYTHONPATH=":".join([str(elsewhere), *sys.path]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.split()[0] == "True", done.stderr[-2000:]
    assert done.stdout.split()[1].startswith(str(elsewhere))  # the other checkout's code ran
    assert library.stat().st_mtime_ns == before


# ---- long runs attended in parts -----------------------------------------------------------------------
# (batch, KV heads, group, d, slots, share read, rows per part): one batch row's three KV heads cut into parts
# (both threads on one batch row), G 1/3/7, parts of one row, and (0) parts as long as the longest run, whose own
# row is then a part of its own
PARTS = [(1, 3, 3, 64, 2000, 0.6, 256), (1, 3, 1, 64, 700, 0.5, 7), (2, 2, 7, 32, 400, 0.3, 1),
         (3, 3, 3, 16, 300, 0.9, 64), (1, 1, 3, 64, 64, 1.0, 0), (2, 3, 3, 64, 500, 0.4, 0)]


def _attend(store, sel, q, own, part_rows):
    b, h, _, d = q.shape
    return fused_select.attend_rows(q.view(b, h, d), store.k[0].view(-1, d), store.v[0].view(-1, d), sel.rows,
                                    sel.counts, own, d ** -0.5, part_rows)


@needs_kernel
@pytest.mark.parametrize("shape", PARTS, ids=["x".join(map(str, s[:5])) + f"-p{s[6]}" for s in PARTS])
def test_runs_attended_in_parts_equal_the_torch_path(shape):
    """Runs cut into parts and merged by log-sum-exp: output and log-sum-exp within 1e-5 of the torch path, the
    value sums within rounding; runs of different lengths side by side, one reading only its own token."""
    b, hkv, g, d, s, ratio, part_rows = shape
    store, sel, q, slots, own = _case(b, hkv, g, d, s, ratio, torch.float32, seed=s + g, empty_head=b > 1)
    part_rows = part_rows or int(sel.counts.max())
    assert int(sel.counts.max()) + 1 > part_rows  # some run has several parts
    ref, lse_ref, sums_ref = _reference(store, sel, q, slots, d ** -0.5)
    out, lse, sums = _attend(store, sel, q, own, part_rows)
    assert (out.view_as(ref) - ref).abs().max() <= 1e-5
    assert (lse.view_as(lse_ref) - lse_ref).abs().max() <= 1e-5
    assert (sums - sums_ref).abs().max() <= 1e-4 * max(1.0, float(sums_ref.abs().max()))


@needs_kernel
def test_parts_depend_on_the_counts_alone():
    """A batch row's numbers are the same bits whatever the threads and whatever batch rows run beside it (the
    parts are cut by its counts, never by the batch or the threads)."""
    b, hkv, g, d, s = 3, 3, 3, 64, 900
    store, sel, q, _, own = _case(b, hkv, g, d, s, 0.5, torch.float32, seed=11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _attend(store, sel, q, own, 100)
        torch.set_num_threads(2)
        two = _attend(store, sel, q, own, 100)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    alone = fused_select.attend_rows(q[1:2].view(1, -1, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                     sel.rows[1:2], sel.counts[1:2], own[1:2], d ** -0.5, 100)
    assert all(torch.equal(x[1:2], y) for x, y in zip(one, alone))


@needs_kernel
def test_the_parts_comparison_catches_a_lost_part():
    """What the comparison above would see of parts merged wrong: a run's first part left out (its counts cut
    by one part's rows, read from the second part on) differs from the torch path."""
    b, hkv, g, d, s = 1, 3, 3, 64, 700
    store, sel, q, slots, own = _case(b, hkv, g, d, s, 0.5, torch.float32, seed=5)
    ref, lse_ref, _ = _reference(store, sel, q, slots, d ** -0.5)
    rows, counts = sel.rows.clone(), sel.counts.clone()
    rows[0, :-64] = sel.rows[0, 64:]
    counts[0, 0] -= 64  # KV head 0 without its first 64 rows, the others' runs in place
    out, lse, _ = fused_select.attend_rows(q.view(b, -1, d), store.k[0].view(-1, d), store.v[0].view(-1, d),
                                           rows, counts, own, d ** -0.5, 64)
    assert (out.view_as(ref) - ref).abs().max() > 1e-3 or (lse.view_as(lse_ref) - lse_ref).abs().max() > 1e-3
