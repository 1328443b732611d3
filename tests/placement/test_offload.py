"""The offloading engine: the KV pool in the slow tier (a memory-mapped file, or another
host buffer) gives the same tokens as the in-memory store with the same policy, with and without a pool
limit; the slow tier never holds more than the limit; the pool file is removed afterwards. The engine's tests
run on the `device` fixture's device (INFINIGEN_TEST_DEVICE=cuda: the "cpu" tier is pinned host memory behind
the GPU, fetched on a copy stream)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from infinigen import runtime
from infinigen.placement import OffloadedKVStore, Placement, kv_slot_bytes
from infinigen.policies import make_policy
from infinigen.selection import ALL

from support.offload import (B, GEN, PROMPT, FifoVictims, PlannedRandom, SlowReads, offload_policy,
                             offload_prompts, run_placed, selective_policy)


POLICIES = ["full", "int4", "h2o", "streaming", "planned-random", "infinigen"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", ["disk", "cpu"])
def test_offloaded_engine_same_tokens(tiny_llama, policy, kind, tmp_path, device):
    model = tiny_llama[1].to(device)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), offload_policy(policy, model))
    # prefetched, whichever is the default (reading in place behind a GPU: test_offload_correction.py)
    pl = Placement(kind, pool_dir=str(tmp_path), read_in_place=False)
    tokens, logits, sess = run_placed(model, pl, offload_policy(policy, model))
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    st, layers = sess.store.stats, model.cfg.num_layers
    # every policy here knows its selection one layer ahead: one fetch per layer and step, each a
    # prefetch, none wasted (what the fetches read is counted at the tier in test_decode_reads_only_...)
    assert st.fetches == GEN * layers and st.on_demand == 0 and st.stale == 0
    if st.bulk == 0:
        assert st.bytes_moved == st.rows_moved * 2 * sess.store.layout.row_bytes > 0
    else:  # disk: selections touching most pages read their whole used layer (counted as such)
        assert kind == "disk" and st.bytes_moved >= st.rows_moved * 2 * sess.store.layout.row_bytes
    # the runtime took the planned slot indices at every selecting layer (InfiniGen: layer 0 is dense)
    selecting = {"full": 0, "int4": 0, "infinigen": layers - 1}.get(policy, layers)
    assert st.reused == GEN * selecting
    assert os.listdir(tmp_path) == []  # the pool file is gone


@pytest.mark.parametrize("policy", ["h2o", "streaming", "infinigen", "infinigen-paper", "full", "int4"])
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_decode_reads_only_the_selected_rows(tiny_llama, policy, kind, tmp_path, device):
    """What a decoding step reads from the slow tier, counted at the tier (not by the store's own
    accounting): for each layer, the rows its selection names (each (batch row, KV head)'s selected valid
    slots, packed as `KVStore.select_rows` packs them: no padding), of key and value; the whole used layer
    only where every entry is read (full cache, INT4, dense layers). A store that reads the layer and selects in
    fast memory fails. (The disk tier's whole-layer reads of selections that touch most pages are off here: the
    next test.)"""
    model = tiny_llama[1].to(device)
    pol = selective_policy(policy, model)
    tokens, pad = (x.to(device) for x in offload_prompts())
    # prefetched: what the tier reads is counted there (read in place, the GPU reads the pinned pool over the bus)
    pl = Placement(kind, pool_dir=str(tmp_path), threaded=False, disk_bulk_share=1.0, read_in_place=False)
    want = [0]

    class Count(runtime.Listener):  # what each layer's selection names, as it reads
        def on_select(self, layer, rows, keep, s):
            store = s.store
            n, row = store.length[layer], 2 * store.layout.row_bytes  # one key and one value vector
            if keep is ALL:
                want[0] += store.bh * n * row
            else:
                want[0] += int((keep[:, :, 0, :n] & store.valid[layer][:, :, :n]).sum()) * row
    sess = pl.new_session(model, B, PROMPT + GEN, pol, listeners=[Count()])
    store = sess.store
    row = 2 * store.layout.row_bytes
    logits = runtime.prefill(model, tokens, sess, pad)
    store.stats.reset()
    measured, whole = 0, 0
    for _ in range(GEN):
        whole += sum(store.bh * n * row for n in store.length)
        with SlowReads(store) as reads:
            logits = runtime.decode(model, logits.argmax(-1), sess)
        measured += reads.bytes
    pl.close(sess)
    assert measured == want[0] == sess.store.stats.bytes_moved
    if policy in ("full", "int4"):
        assert measured == whole
    else:
        assert measured < whole  # a real subset was read (layer 0 is dense for InfiniGen)


def test_touched_page_share():
    from infinigen.placement.transfer import touched_page_share
    rows = torch.tensor
    assert touched_page_share(rows([0]), 256, 64) == 0.25  # 64 rows of 256 B: 4 pages
    assert touched_page_share(rows([0, 1, 15]), 256, 64) == 0.25  # one page
    assert touched_page_share(rows([0, 16, 63]), 256, 64) == 0.75
    assert touched_page_share(rows([1]), 3000, 4) == pytest.approx(2 / 3)  # bytes 3000-5999: pages 0 and 1 of 3
    assert touched_page_share(rows([], dtype=torch.long), 256, 0) == 0.0


@pytest.mark.parametrize("share,expect", [(0.0, "bulk"), (0.25, "bulk"), (1.0, "rows")])
def test_disk_reads_whole_layers_when_a_selection_touches_most_pages(tiny_llama, tmp_path, share, expect):
    """Disk tier: a selection whose rows lie on more than `disk_bulk_share` of the used layer's pages is
    read as the whole used layer (one sequential pass, counted at the tier and in bytes_moved) and selected
    in RAM; the tokens and logits are those of the in-memory store either way. On this tiny model (rows of
    64 B) every selection touches every page, so the default (0.25) reads whole layers."""
    _, model = tiny_llama
    pol = selective_policy("infinigen", model)
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), pol)
    pl = Placement("disk", pool_dir=str(tmp_path), threaded=False, disk_bulk_share=share)
    tokens, pad = offload_prompts()
    sess = pl.new_session(model, B, PROMPT + GEN, pol)
    store = sess.store
    logits = runtime.prefill(model, tokens, sess, pad)
    store.stats.reset()
    measured, whole, out, steps = 0, 0, [], []
    for _ in range(GEN):
        whole += sum(store.bh * n * 2 * store.layout.row_bytes for n in store.length)
        t = logits.argmax(-1)
        out.append(t)
        with SlowReads(store) as reads:
            logits = runtime.decode(model, t, sess)
        steps.append(logits)
        measured += reads.bytes
    st = store.stats
    pl.close(sess)
    assert torch.equal(torch.stack(out, 1), ref_tokens)
    assert torch.allclose(torch.stack(steps, 1), ref_logits, atol=1e-5, rtol=0)
    assert measured == st.bytes_moved
    selecting = GEN * (model.cfg.num_layers - 1)  # layer 0 is dense here
    if expect == "bulk":
        assert st.bulk == selecting and measured == whole
    else:
        assert st.bulk == 0 and measured < whole


@pytest.mark.parametrize("prefetch,threaded", [(False, True), (True, False)])
def test_no_prefetch_and_inline_modes(tiny_llama, prefetch, threaded, tmp_path, device):
    model = tiny_llama[1].to(device)
    ref_tokens, _, _ = run_placed(model, Placement("none"), PlannedRandom())
    tokens, _, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), prefetch=prefetch, threaded=threaded),
                           PlannedRandom())
    assert torch.equal(tokens, ref_tokens)
    assert (sess.store.stats.on_demand > 0) == (not prefetch)


def test_opt_model_offloaded(tiny_opt, tmp_path, device):
    model = tiny_opt[1].to(device)
    ref_tokens, _, _ = run_placed(model, Placement("none"), make_policy("h2o"))
    tokens, _, _ = run_placed(model, Placement("disk", pool_dir=str(tmp_path)), make_policy("h2o"))
    assert torch.equal(tokens, ref_tokens)


def _allocators():
    yield "fifo-local", FifoVictims
    try:
        from infinigen import pool
    except ImportError:
        return
    for name in ("counter", "lru", "fifo"):
        yield f"pool-{name}", (lambda name=name: pool.make_pool(name))


@pytest.mark.parametrize("policy", ["full", "int4", "planned-random", "infinigen"])
@pytest.mark.parametrize("alloc_name,alloc", list(_allocators()))
def test_pool_limit_same_tokens_and_bounded(tiny_llama, policy, alloc_name, alloc, tmp_path, device):
    model = tiny_llama[1].to(device)
    capacity = PROMPT + 4  # the last GEN-4 tokens overwrite victims
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), offload_policy(policy, model), capacity=capacity,
                                     allocator=alloc())
    limit = capacity * kv_slot_bytes(model, B, offload_policy(policy, model), "disk")
    pl = Placement("disk", pool_dir=str(tmp_path))
    tokens, logits, sess = run_placed(model, pl, offload_policy(policy, model), pool_bytes=limit, allocator=alloc(),
                                      keep=True)
    store = sess.store
    assert store.capacity == capacity
    # the limit is exactly `capacity` slots: the pool is that big, no bigger and no smaller, on disk too
    assert store.slow_bytes() == limit == sum(t.numel() * t.element_size() for t in store.tier.tensors)
    assert store.tier.files_bytes() == limit  # the files' sizes
    assert all(n <= capacity for n in store.length)
    pl.close(sess)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    assert os.listdir(tmp_path) == []


def test_pool_bytes_too_small_is_a_user_error(tiny_llama):
    from infinigen.errors import UserError
    _, model = tiny_llama
    with pytest.raises(UserError):
        Placement("cpu", pool_bytes=10).new_session(model, B, 40, make_policy("full"))


@pytest.mark.parametrize("kw", [dict(capacity=10), dict(capacity=0.25)], ids=str)
def test_pool_smaller_than_the_prompt_is_a_user_error(tiny_llama, kw):
    """Found when the store is made, before any work: a pool of 10 tokens cannot hold a 24-token prompt."""
    from infinigen.errors import UserError
    _, model = tiny_llama
    with pytest.raises(UserError, match="cannot hold the 24-token prompt"):
        Placement("disk", **kw).new_session(model, B, 40, make_policy("full"), prompt_len=PROMPT)


def test_int4_pool_is_packed(tiny_llama):
    """INT4 in the slow tier really takes 4 bits per value (+ a scale and minimum per group)."""
    _, model = tiny_llama
    cfg = model.cfg
    plain = kv_slot_bytes(model, B, make_policy("full"), "cpu")
    packed = kv_slot_bytes(model, B, make_policy("int4"), "cpu")
    d = cfg.head_dim
    per_row = 2 * (d // 2 + 2 * 4)  # key and value: d/2 bytes of codes + float32 scale and minimum
    assert packed == cfg.num_layers * B * cfg.num_kv_heads * per_row
    assert packed < plain


def test_teacher_forced_on_offloaded_store(tiny_llama, tmp_path, device):
    """The replay path (stateful policy) reads through the same store methods."""
    model = tiny_llama[1].to(device)
    tokens = offload_prompts(batch=2, length=30)[0].to(device)
    ref = runtime.teacher_forced(model, tokens, 20, Placement().new_session(model, 2, 30, make_policy("h2o")))
    pl = Placement("disk", pool_dir=str(tmp_path))
    sess = pl.new_session(model, 2, 30, make_policy("h2o"))
    got = runtime.teacher_forced(model, tokens, 20, sess)
    pl.close(sess)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_disk_pool_file_lives_in_the_chosen_dir_and_goes(tiny_llama, tmp_path):
    _, model = tiny_llama
    pl = Placement("disk", pool_dir=str(tmp_path / "kv"))
    sess = pl.new_session(model, B, 40, make_policy("full"))
    assert isinstance(sess.store, OffloadedKVStore)
    # the files live in the chosen dir but have no name there (nothing outlives a killed run)
    fds = sess.store.tier.fds
    assert fds and all(os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path / "kv") + "/") for fd in fds)
    assert os.listdir(tmp_path / "kv") == []
    assert sess.store.tier.files_bytes() == sess.store.slow_bytes()
    pl.close(sess)
    assert os.listdir(tmp_path / "kv") == []


# ---- infinigen bench ---------------------------------------------------------------------------------
def test_bench_cli_smoke(tiny_checkpoint, tmp_path, monkeypatch):
    """`infinigen bench` on a tiny random checkpoint: every system runs, the JSON has the promised keys,
    the offloaded full cache gives ideal's tokens, and the PNG is written."""
    from infinigen.cli import main
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))  # InfiniGen's skew artifact goes here
    text = tmp_path / "text.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 40)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "-m", str(tiny_checkpoint), "--text", str(text), "--prompt-len", "24,40",
                 "--batch-size", "1,2",
                 "--gen-len", "4", "--policy", "full,infinigen,h2o,int4", "--kv-offload", "cpu,disk",
                 "--pool-dir", str(tmp_path / "pool"), "--breakdown", "1", "--json", str(out), "--plot", str(png),
                 "--knob", "infinigen.preset=flat", "--knob", "infinigen.dense_layers=0",
                 "--knob", "infinigen.min_fetch=0",
                 "--dtype", "float32"])  # the int4 pool's size is compared with a float32 pool below
    assert code == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    systems = {r["system"] for r in rows}
    assert {"ideal", "full offload (cpu)", "full offload (disk)", "infinigen (cpu)", "h2o (disk)", "int4 (disk)",
            "transformers DynamicCache"} <= systems
    assert len(rows) == 2 * 2 * len(systems)
    keys = {"prefill_s", "decode_ms_per_step", "decode_tokens_per_s", "bytes_moved_per_token", "peak_fast_bytes",
            "peak_slow_bytes", "relative_kv", "x_vs_transformers", "x_vs_ideal", "x_vs_full_offload", "breakdown"}
    for r in rows:
        if r["policy"] != "transformers":
            assert keys <= set(r), keys - set(r)
            assert set(r["breakdown"]["per_block_ms"]) == {"speculation", "prefetch issue", "fetch wait", "attention",
                                                                 "mlp", "other"}
        if r["system"].startswith("full offload"):
            assert r["tokens_agree_with_ideal"] == 1.0
            assert r["bytes_moved_per_token"] > 0 and r["peak_slow_bytes"] > 0
        if r["policy"] == "infinigen":
            assert "speculation_memory" in r and r["relative_kv"] < 1
    int4 = next(r for r in rows if r["policy"] == "int4")
    full = next(r for r in rows if r["system"] == "full offload (cpu)" and r["batch"] == int4["batch"]
                and r["prompt_len"] == int4["prompt_len"])
    assert int4["peak_slow_bytes"] < full["peak_slow_bytes"] / 2  # packed 4-bit pool (head_dim 8 here)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any((tmp_path / "pool").iterdir())  # pool files removed


def test_bench_cli_bad_input(tiny_checkpoint):
    from infinigen.cli import main
    assert main(["bench", "-m", str(tiny_checkpoint), "--kv-offload", "tape"]) == 2
    assert main(["bench", "-m", str(tiny_checkpoint), "--batch-size", "0"]) == 2
    assert main(["bench", "-m", str(tiny_checkpoint), "--pool-bytes", "lots"]) == 2
    assert main(["bench", "--synthetic", "opt-6.7b", "--policy", "infinigen"]) == 2  # needs --fixed-ratio


def test_bench_synthetic_fixed_ratio(tmp_path):
    """A synthetic shape (random weights, few layers): InfiniGen reads the fixed share of the tokens."""
    from infinigen.cli import main
    out = tmp_path / "s.json"
    code = main(["bench", "--synthetic", "smollm2-135m", "--layers", "3", "--prompt-len", "40", "--batch-size", "1",
                 "--gen-len", "3", "--policy", "infinigen", "--fixed-ratio", "0.25", "--kv-offload", "cpu",
                 "--knob", "dense_layers=0", "--no-transformers", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    ig = next(r for r in rows if r["policy"] == "infinigen")
    assert json.loads(out.read_text())["synthetic"] is True
    assert 0.2 <= ig["relative_kv_speculated"] <= 0.3


@pytest.mark.parametrize("fraction", [0.4, 1.0])
@pytest.mark.parametrize("threaded", [True, False])
def test_weights_streamed_from_the_slow_tier(make_tiny, fraction, threaded, tmp_path):
    """Layers whose weights live in a memory-mapped file and stream per layer give the same tokens;
    the weights are back in fast memory afterwards and the file is gone."""
    from infinigen.placement.weights import WeightStreamer, streamed_layers
    _, model = make_tiny("llama", num_hidden_layers=5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the same KV placement without streamed weights: an in-memory store reads a selection as packed rows, in
    # other float summation orders than an offloaded store's gathered slots
    disk = Placement("disk", pool_dir=str(tmp_path))
    ref_tokens, ref_logits, _ = run_placed(model, disk, offload_policy("infinigen", model))
    with WeightStreamer(model, fraction, "disk", tmp_path, threaded=threaded) as ws:
        assert ws.layers == streamed_layers(5, fraction) and ws.slow_bytes > 0
        tokens, logits, _ = run_placed(model, disk, offload_policy("infinigen", model))
        assert ws.bytes_moved > 0
    assert torch.equal(tokens, ref_tokens) and torch.equal(logits, ref_logits)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert os.listdir(tmp_path) == []


def test_shared_prefill_replays_to_the_same_tokens(tiny_llama, tmp_path):
    """The benchmark's shared prefill (one real prefill replayed into each session) decodes exactly as a
    real prefill does, for stateful policies too."""
    from infinigen.bench import BenchSettings, SharedPrefill, System, run_ours
    _, model = tiny_llama
    tokens, _ = offload_prompts(batch=2, length=30)
    s = BenchSettings(prompt_lens=[30], batch_sizes=[2], gen_len=5, pool_dir=str(tmp_path))
    shared = SharedPrefill(model, tokens, str(tmp_path))
    try:
        for name in ("full", "h2o", "infinigen"):
            for tier in ("none", "disk"):
                system = System(name, offload_policy(name, model), tier)
                real = run_ours(model, tokens, system, s)
                replayed = run_ours(model, tokens, system, s, shared)
                assert torch.equal(real["_tokens"], replayed["_tokens"]), (name, tier)
                assert replayed["prefill_shared"] and replayed["relative_kv"] == real["relative_kv"]
    finally:
        shared.close()
    assert os.listdir(tmp_path) == []


def test_generate_with_an_offloaded_pool(tiny_checkpoint, tmp_path):
    """`generate` takes a placement and gives the in-memory tokens."""
    from infinigen.generate import generate
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    prompts = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome"]
    ref = generate(model, tok, prompts, max_new_tokens=6, policy=make_policy("h2o"))
    got = generate(model, tok, prompts, max_new_tokens=6, policy=make_policy("h2o"),
                   placement=Placement("disk", pool_dir=str(tmp_path)))
    assert got.tokens == ref.tokens
    assert os.listdir(tmp_path) == []  # the pool file went with the session


@pytest.mark.integration
@pytest.mark.parametrize("policy", ["full", "h2o", "int4", "infinigen"])
def test_default_model_offloaded_to_disk(default_model, policy, tmp_path):
    """The default model on the disk tier generates what it generates with everything in RAM."""
    model, tok = default_model
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
            "must be in want of a wife. However little known the feelings or views of such a man may be ") * 3
    ids = tok(text)["input_ids"][:96]
    tokens = torch.tensor([ids, ids[::-1]])
    knobs = {"skew": False, "dense_layers": (0,)} if policy == "infinigen" else {}

    def run(placement):
        sess = placement.new_session(model, 2, 96 + 8, make_policy(policy, **knobs))
        logits = runtime.prefill(model, tokens, sess)
        out = []
        for _ in range(8):
            t = logits.argmax(-1)
            out.append(t)
            logits = runtime.decode(model, t, sess)
        placement.close(sess)
        return torch.stack(out, 1)

    assert torch.equal(run(Placement("disk", pool_dir=str(tmp_path))), run(Placement("none")))
    assert os.listdir(tmp_path) == []


def test_bench_compiles_the_step_before_the_policies_measure_their_crossing(tiny_checkpoint, tmp_path, monkeypatch):
    """InfiniGen's `prepare` measures where selecting pays against the full cache's decoding step: in `bench` that
    is the compiled step the run decodes with, so the step is compiled first (an eager full cache is several
    times slower, which would put the crossing far too early)."""
    from infinigen.cli import main
    from infinigen.commands import bench
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(bench, "enable_compile", lambda net, *a, **k: calls.append("compile") or "")
    real_prepare = bench.prepare_policies
    monkeypatch.setattr(bench, "prepare_policies", lambda *a, **k: calls.append("prepare") or real_prepare(*a, **k))
    assert main(["bench", "-m", str(tiny_checkpoint), "--prompt-len", "24", "--gen-len", "2", "--policy", "full",
                 "--no-ideal", "--no-transformers", "--dtype", "float32"]) == 0
    assert calls == ["compile", "prepare"]
