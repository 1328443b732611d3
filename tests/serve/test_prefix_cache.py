"""Prefix cache: a prompt that continues a cached prefix is prefilled from there (its first tokens' keys and
values restored, not recomputed) and gets the tokens a prefill of the whole prompt gives; the server's
engine reuses shared prefixes by blocks, counts hits, and evicts by LRU under its byte limit."""
from __future__ import annotations

import os

import pytest
import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies import make_policy
from infinigen.serve.engine import Engine, Request


def _mats(model, seed=3):
    c = model.cfg
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim, generator=g,
                                       dtype=torch.float64))[0]


def _policy(name, model):
    if name == "infinigen":  # the default preset (4-bit speculation keys), a real subset on short prompts
        return make_policy("infinigen", dense_layers=(0,), alpha=1.0).with_skew(_mats(model))
    if name == "streaming":
        return make_policy("streaming", sinks=2, window=6)
    if name == "oracle":
        return make_policy("oracle", ratio=0.3)
    return make_policy(name)


def _tokens(model, n, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, (1, n), generator=g)


def _greedy(model, session, logits, n):
    out = [int(logits.argmax(-1))]
    for _ in range(n - 1):
        out.append(int(runtime.decode(model, torch.tensor([out[-1]]), session).argmax(-1)))
    return out


def _whole(model, pol, ids, n):
    sess = Placement().new_session(model, 1, ids.shape[1] + n, pol)
    return _greedy(model, sess, runtime.prefill(model, ids, sess), n), sess


def _continued(model, pol, ids, cached, n, layers_per_slice=0):
    # the prefix's keys and values as an earlier request's session left them
    donor = Placement().new_session(model, 1, cached, make_policy("full"))
    runtime.prefill(model, ids[:, :cached], donor)
    keys = [donor.store.past(i)[0].clone() for i in range(model.cfg.num_layers)]
    values = [donor.store.past(i)[1].clone() for i in range(model.cfg.num_layers)]
    sess = Placement().new_session(model, 1, ids.shape[1] + n, pol)
    sess.restore_prefix(keys, values)
    slices = runtime.prefill_in_slices(model, ids[:, cached:], sess, layers_per_slice=layers_per_slice,
                                       cached=cached)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return _greedy(model, sess, done.value, n), sess


@pytest.mark.parametrize("policy", ["full", "infinigen", "streaming", "oracle"])
def test_a_prompt_continued_from_a_cached_prefix_gets_the_tokens_of_the_whole_prefill(make_tiny, policy):
    _, model = make_tiny("llama", num_hidden_layers=3)
    ids = _tokens(model, 40)
    pol = _policy(policy, model)
    if policy == "infinigen":
        assert pol.continues_prefill()
    whole, ws = _whole(model, pol, ids, 12)
    for cached in (1, 16, 39):
        cont, cs = _continued(model, pol, ids, cached, 12, layers_per_slice=cached % 2)
        assert cont == whole, (policy, cached)
        if policy == "infinigen":  # the speculation keys cover the whole prompt, as a whole prefill builds them
            assert cs.stats.overall() == pytest.approx(ws.stats.overall()) and ws.stats.overall() < 0.9


def test_policies_that_read_the_prompt_queries_do_not_continue(make_tiny):
    """H2O's prompt scores and the paper's partial columns need every prompt row's query: a cached prefix
    cannot give them, so such a policy says so and a continued prefill refuses it."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    assert not make_policy("h2o").continues_prefill()
    assert not make_policy("infinigen", preset="paper").continues_prefill()
    assert not make_policy("int4").continues_prefill()
    assert make_policy("full").continues_prefill()
    sess = Placement().new_session(model, 1, 20, make_policy("h2o"))
    with pytest.raises(ValueError, match="continues_prefill"):
        next(runtime.prefill_in_slices(model, _tokens(model, 4), sess, cached=3))


def _alone(model, pol, prompt, n):
    return _whole(model, pol, torch.tensor([prompt]), n)[0]


def _run(eng, prompt, n):
    req = eng.submit(Request(prompt=prompt, max_tokens=n))
    while not eng.idle():
        eng.step()
    assert req.finish == "length"
    return req.tokens


@pytest.mark.parametrize("policy", ["full", "infinigen", "streaming", "oracle", "int4", "h2o"])
def test_requests_sharing_a_document_reuse_its_blocks_and_get_their_tokens_alone(make_tiny, policy):
    _, model = make_tiny("llama", num_hidden_layers=3)
    doc = _tokens(model, 27, seed=7)[0].tolist()
    questions = [_tokens(model, n, seed=s)[0].tolist() for n, s in ((5, 8), (9, 9), (3, 10))]
    pol = _policy(policy, model)
    eng = Engine(model, pol, Placement(), max_batch=4, prefix_block=8)
    got = [_run(eng, doc + q, 6) for q in questions]
    for q, tokens in zip(questions, got):
        assert tokens == _alone(model, pol, doc + q, 6), (policy, len(q))
    s = eng.snapshot()
    if policy in ("h2o", "int4"):  # H2O's prompt scores read every prompt row's query; INT4's store holds
        # 4-bit values where a whole prefill attends over the computed ones: no cache, every prompt prefilled
        assert eng.prefix is None and "prefix_cache_hits" not in s
        return
    # requests 2 and 3 reuse the document's 3 whole blocks (24 tokens), and only prefill what follows
    assert s["prefix_cache_hits"] == 2 and s["prefix_cache_hit_tokens"] == 48
    assert s["prefix_cache_bytes"] <= s["prefix_cache_limit_bytes"] and s["prefix_cache_evictions"] == 0


def test_the_cache_never_serves_a_prefix_that_differs_anywhere_before_the_block_end(make_tiny):
    """Blocks are chained: the same block of tokens after a different beginning is another key."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    eng = Engine(model, make_policy("full"), Placement(), prefix_block=8)
    a = _tokens(model, 30, seed=11)[0].tolist()
    b = list(a)
    b[3] = (b[3] + 1) % model.cfg.vocab_size  # differs in block 0 only
    _run(eng, a, 3)
    assert _run(eng, b, 3) == _alone(model, make_policy("full"), b, 3)
    assert eng.snapshot()["prefix_cache_hits"] == 0
    c = a[:16] + [(t + 1) % model.cfg.vocab_size for t in a[16:]]  # a's first two blocks, then something else
    assert _run(eng, c, 3) == _alone(model, make_policy("full"), c, 3)
    s = eng.snapshot()
    assert s["prefix_cache_hits"] == 1 and s["prefix_cache_hit_tokens"] == 16


def test_a_block_is_keyed_by_everything_before_it_not_by_its_own_tokens(make_tiny):
    """A block of tokens cached at position 8 is not reused for a prompt that starts with those tokens: its keys
    were rotated for position 8 and attended to the block before it."""
    _, model = make_tiny("llama", num_hidden_layers=2)
    eng = Engine(model, make_policy("full"), Placement(), prefix_block=8)
    first, second = _tokens(model, 8, seed=30)[0].tolist(), _tokens(model, 8, seed=31)[0].tolist()
    _run(eng, first + second + [5], 3)  # caches [first] and [first, second]
    prompt = second + [6, 7, 9]
    assert _run(eng, prompt, 6) == _alone(model, make_policy("full"), prompt, 6)
    assert eng.snapshot()["prefix_cache_hits"] == 0


def test_lru_eviction_keeps_the_cache_under_its_byte_limit(make_tiny):
    _, model = make_tiny("llama", num_hidden_layers=2)
    probe = Engine(model, make_policy("full"), Placement(), prefix_block=8)
    _run(probe, _tokens(model, 9, seed=1)[0].tolist(), 2)
    block = probe.snapshot()["prefix_cache_bytes"]  # one block of 8 tokens
    assert block > 0
    eng = Engine(model, make_policy("full"), Placement(), prefix_block=8, prefix_cache_bytes=3 * block)
    docs = [_tokens(model, 17, seed=20 + i)[0].tolist() for i in range(3)]  # two blocks each
    for d in docs:
        _run(eng, d, 2)
    s = eng.snapshot()
    assert s["prefix_cache_bytes"] <= 3 * block and s["prefix_cache_evictions"] == 3
    # the oldest document went first; the newest is whole
    _run(eng, docs[2] + [5], 2)
    _run(eng, docs[0] + [5], 2)
    s = eng.snapshot()
    assert s["prefix_cache_hits"] == 1 and s["prefix_cache_hit_tokens"] == 16


def test_metrics_count_prefix_cache_hits(make_tiny):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from infinigen.serve.metrics import registry
    _, model = make_tiny("llama", num_hidden_layers=2)
    eng = Engine(model, make_policy("full"), Placement(), prefix_block=8)
    doc = _tokens(model, 20, seed=3)[0].tolist()
    _run(eng, doc + [7], 2)
    _run(eng, doc + [9, 4], 2)
    text = generate_latest(registry(eng)).decode()
    assert "infinigen_prefix_cache_hits_total 1.0" in text and "infinigen_prefix_cache_hit_tokens_total 16.0" in text


# ---- the folder (--prefix-cache-dir): blocks that survive a restart --------------------------------------
def _restarted(model, pol, folder, **kw):
    """An engine as a restarted server makes it: a new one over the same folder."""
    return Engine(model, pol, Placement(), prefix_block=8, prefix_cache_dir=folder, **kw)


def _served(eng, prompt, n):
    tokens = _run(eng, prompt, n)
    eng.prefix.disk.flush()
    return tokens


@pytest.mark.parametrize("policy", ["full", "infinigen", "streaming", "oracle"])
def test_a_request_served_from_the_folder_after_a_restart_gets_its_tokens_alone(make_tiny, policy, tmp_path):
    _, model = make_tiny("llama", num_hidden_layers=3)
    doc = _tokens(model, 27, seed=7)[0].tolist()
    q1, q2 = _tokens(model, 5, seed=8)[0].tolist(), _tokens(model, 9, seed=9)[0].tolist()
    pol = _policy(policy, model)
    first = _restarted(model, pol, tmp_path)
    assert _served(first, doc + q1, 6) == _alone(model, pol, doc + q1, 6)
    first.stop()
    assert len(list(tmp_path.glob("*.safetensors"))) == 4  # 32 tokens: 4 whole blocks
    second = _restarted(model, pol, tmp_path)
    assert second.prefix.bytes == 0  # nothing in memory: what it reuses comes from the folder
    assert _served(second, doc + q2, 6) == _alone(model, pol, doc + q2, 6), policy
    s = second.snapshot()
    assert s["prefix_cache_disk_hits"] == 1 and s["prefix_cache_disk_hit_tokens"] == 24  # the document's 3 blocks
    assert s["prefix_cache_hit_tokens"] == 24 and s["prefix_cache_disk_skipped"] == 0


def test_a_hit_from_the_folder_is_not_read_again_from_the_requests_store(make_tiny, tmp_path):
    """A memory cache too small for a block (a server's holds a few of a long document's): a hit's blocks come from
    the folder and do not stay in memory, and the insert at the first token reads from the request's store only the
    block the folder lacks (from a disk pool, a file read)."""
    _, model = make_tiny("llama", num_hidden_layers=3)
    doc = _tokens(model, 27, seed=7)[0].tolist()
    q1, q2 = _tokens(model, 5, seed=8)[0].tolist(), _tokens(model, 9, seed=9)[0].tolist()
    pol = _policy("full", model)
    first = _restarted(model, pol, tmp_path)
    _served(first, doc + q1, 2)
    first.stop()
    half_a_block = next(tmp_path.glob("*.safetensors")).stat().st_size // 2
    second = _restarted(model, pol, tmp_path, prefix_cache_bytes=half_a_block, prefix_cache_dir_bytes=1 << 30)
    reads, insert = [], second.prefix.insert

    def counted(tokens, store):  # the store's reads during the insert, by block
        real = store.keys_values
        store.keys_values = lambda layer, s, e: (reads.append(s // 8), real(layer, s, e))[1]
        try:
            insert(tokens, store)
        finally:
            del store.keys_values
    second.prefix.insert = counted
    assert _served(second, doc + q2, 6) == _alone(model, pol, doc + q2, 6)
    assert second.snapshot()["prefix_cache_disk_hit_tokens"] == 24  # the document's 3 blocks from the folder
    assert set(reads) == {3} and len(reads) == model.cfg.num_layers  # the new fourth block only, every layer
    assert len(list(tmp_path.glob("*.safetensors"))) == 5
    second.stop()


def _other_model(model):
    """Another model of the same shapes: its blocks have this model's layout but not its keys and values."""
    import copy
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.25)
    return other


def test_corrupt_and_foreign_files_are_skipped_and_the_answer_stays_exact(make_tiny, tmp_path):
    from infinigen.serve.prefix import prefix_fingerprint
    _, model = make_tiny("llama", num_hidden_layers=2)
    pol = make_policy("full")
    doc = _tokens(model, 24, seed=12)[0].tolist()  # 3 blocks
    prompt = doc + [5, 6, 7]
    alone = _alone(model, pol, prompt, 6)
    other = _other_model(model)
    assert prefix_fingerprint(other) != prefix_fingerprint(model)
    # another model's blocks of the same tokens, under this model's file names
    foreign = _restarted(other, pol, tmp_path / "other")
    _served(foreign, prompt, 2)
    foreign.stop()
    eng = _restarted(model, pol, tmp_path / "mine")
    _served(eng, prompt, 2)
    eng.stop()
    mine = sorted((tmp_path / "mine").glob("*.safetensors"))
    assert len(mine) == 3
    disk = eng.prefix.disk
    keys = eng.prefix._keys(prompt, 3)
    # another model's block 2 in place of ours (its name, its layout): block 1 only
    (tmp_path / "other" / foreign.prefix.disk.path(keys[1]).name).replace(disk.path(keys[1]))
    again = _restarted(model, pol, tmp_path / "mine")
    assert _served(again, prompt, 6) == alone
    s = again.snapshot()
    assert s["prefix_cache_disk_skipped"] == 1 and s["prefix_cache_disk_hit_tokens"] == 8
    again.stop()
    # the skipped block was computed again and written anew; now block 3 is truncated: blocks 1 and 2
    raw = disk.path(keys[2]).read_bytes()
    disk.path(keys[2]).write_bytes(raw[: len(raw) // 2])
    again = _restarted(model, pol, tmp_path / "mine")
    assert _served(again, prompt, 6) == alone
    s = again.snapshot()
    assert s["prefix_cache_disk_skipped"] == 1 and s["prefix_cache_disk_hit_tokens"] == 16
    again.stop()
    # block 1 is garbage: nothing from the folder
    disk.path(keys[0]).write_bytes(b"\x08" + bytes(40))
    again = _restarted(model, pol, tmp_path / "mine")
    assert _served(again, prompt, 6) == alone
    s = again.snapshot()
    assert s["prefix_cache_disk_skipped"] == 1 and s["prefix_cache_disk_hits"] == 0
    again.stop()
    # every bad file was replaced: the whole document from the folder
    last = _restarted(model, pol, tmp_path / "mine")
    assert _served(last, prompt, 6) == alone
    s = last.snapshot()
    assert s["prefix_cache_disk_skipped"] == 0 and s["prefix_cache_disk_hit_tokens"] == 24


def test_the_folder_stays_under_its_byte_limit(make_tiny, tmp_path):
    _, model = make_tiny("llama", num_hidden_layers=2)
    probe = _restarted(model, make_policy("full"), tmp_path / "probe")
    _served(probe, _tokens(model, 9, seed=1)[0].tolist(), 2)
    size = next((tmp_path / "probe").glob("*.safetensors")).stat().st_size  # one block's file
    eng = _restarted(model, make_policy("full"), tmp_path / "cache", prefix_cache_dir_bytes=3 * size)
    docs = [_tokens(model, 17, seed=20 + i)[0].tolist() for i in range(3)]  # two blocks each
    for d in docs:
        _served(eng, d, 2)
    files = list((tmp_path / "cache").glob("*.safetensors"))
    s = eng.snapshot()
    assert len(files) == 3 and sum(f.stat().st_size for f in files) <= 3 * size
    assert s["prefix_cache_disk_evictions"] == 3 and s["prefix_cache_disk_bytes"] <= 3 * size
    eng.stop()
    # the least recently used went first: the newest document is whole in the folder, the oldest is gone
    again = _restarted(model, make_policy("full"), tmp_path / "cache", prefix_cache_dir_bytes=3 * size)
    _served(again, docs[2] + [5], 2)
    _served(again, docs[0] + [5], 2)
    s = again.snapshot()
    assert s["prefix_cache_disk_hits"] == 1 and s["prefix_cache_disk_hit_tokens"] == 16


def test_metrics_count_prefix_cache_disk_hits(make_tiny, tmp_path):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from infinigen.serve.metrics import registry
    _, model = make_tiny("llama", num_hidden_layers=2)
    doc = _tokens(model, 20, seed=3)[0].tolist()
    first = _restarted(model, make_policy("full"), tmp_path)
    _served(first, doc + [7], 2)
    first.stop()
    eng = _restarted(model, make_policy("full"), tmp_path)
    _served(eng, doc + [9, 4], 2)
    text = generate_latest(registry(eng)).decode()
    assert "infinigen_prefix_cache_disk_hits_total 1.0" in text
    assert "infinigen_prefix_cache_disk_hit_tokens_total 16.0" in text
    assert "infinigen_prefix_cache_hits_total 1.0" in text and "infinigen_prefix_cache_disk_skipped_total 0.0" in text


def test_serve_checks_the_prefix_cache_folder_before_loading(capsys, tmp_path):
    from infinigen.cli import main
    a_file = tmp_path / "f"
    a_file.write_text("")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    cases = [["--prefix-cache-dir", str(a_file)], ["--prefix-cache-dir", str(a_file / "sub")],
             ["--prefix-cache-dir-bytes", "lots"]]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append(["--prefix-cache-dir", str(ro / "sub")])
    for argv in cases:
        assert main(["serve", "--model", "/nonexistent", "--port", "0", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("infinigen: error:") and err.count("\n") == 1 and "prefix-cache-dir" in err, err


def test_a_model_that_differs_in_one_layers_values_reads_none_of_the_others_blocks(make_tiny, tmp_path):
    """The fingerprint samples every tensor: two models that differ only in one middle layer's v_proj (which
    the skew fingerprint's q/k weights of the first and last layers do not see) keep apart on disk."""
    import copy

    from infinigen.serve.prefix import prefix_fingerprint
    _, model = make_tiny("llama", num_hidden_layers=3)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.layers[1].attn.v_proj.weight.mul_(1.25)
    assert prefix_fingerprint(other) != prefix_fingerprint(model)
    pol = make_policy("full")
    prompt = _tokens(model, 24, seed=12)[0].tolist() + [5, 6, 7]
    foreign = _restarted(other, pol, tmp_path)  # the other model's blocks of this prompt, in the same folder
    _served(foreign, prompt, 2)
    foreign.stop()
    eng = _restarted(model, pol, tmp_path)
    assert _served(eng, prompt, 6) == _alone(model, pol, prompt, 6)
    s = eng.snapshot()
    assert s["prefix_cache_disk_hits"] == 0 and s["prefix_cache_hits"] == 0
    eng.stop()


def test_a_block_evicted_meanwhile_is_a_miss_and_old_temp_files_are_cleaned(make_tiny, tmp_path):
    import time
    _, model = make_tiny("llama", num_hidden_layers=2)
    stale, fresh = tmp_path / ".x.safetensors.1.2.partial", tmp_path / ".y.safetensors.3.4.partial"
    for f in (stale, fresh):
        f.write_bytes(b"half a block")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    eng = _restarted(model, make_policy("full"), tmp_path)
    assert not stale.exists() and fresh.exists()  # a killed server's, and one another server may be writing
    doc = _tokens(model, 16, seed=4)[0].tolist()
    _served(eng, doc + [1], 2)
    eng.stop()
    again = _restarted(model, make_policy("full"), tmp_path)
    again.prefix.disk.path(again.prefix._keys(doc, 2)[1]).unlink()  # deleted by another server sharing the folder
    assert _served(again, doc + [3], 3) == _alone(model, make_policy("full"), doc + [3], 3)
    s = again.snapshot()
    assert s["prefix_cache_disk_hit_tokens"] == 8 and s["prefix_cache_disk_skipped"] == 0


@pytest.mark.parametrize("bad", ["dtype", "shape", "key", "layers"])
def test_a_file_with_this_models_fingerprint_but_other_tensors_is_skipped(make_tiny, tmp_path, bad):
    from safetensors.torch import load_file, save_file
    _, model = make_tiny("llama", num_hidden_layers=2)
    doc = _tokens(model, 16, seed=6)[0].tolist()
    first = _restarted(model, make_policy("full"), tmp_path)
    _served(first, doc + [1], 2)
    first.stop()
    disk = first.prefix.disk
    keys = first.prefix._keys(doc, 2)
    path = disk.path(keys[1])
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    if bad == "dtype":  # the same values, another dtype
        tensors = {n: t.double() for n, t in tensors.items()}
    elif bad == "shape":  # a token short
        tensors = {n: t[:, :, :-1].contiguous() for n, t in tensors.items()}
    elif bad == "key":  # block 1's file under block 2's name
        tensors = load_file(str(disk.path(keys[0])))
        meta["key"] = keys[0].hex()
    else:  # a layer missing
        tensors = {n: t for n, t in tensors.items() if not n.endswith("1")}
    save_file(tensors, str(path), metadata=meta)
    again = _restarted(model, make_policy("full"), tmp_path)
    assert _served(again, doc + [2], 4) == _alone(model, make_policy("full"), doc + [2], 4)
    s = again.snapshot()
    assert s["prefix_cache_disk_skipped"] == 1 and s["prefix_cache_disk_hit_tokens"] == 8, bad


def test_blocks_waiting_for_the_writer_are_bounded_in_bytes(tmp_path, monkeypatch):
    """A long prompt's blocks are copies in memory until written: the writer holds at most IN_FLIGHT_BYTES of
    them, and the insert waits (a server under a memory bound must not hold a whole prompt's blocks twice)."""
    import threading
    import time

    from infinigen.serve import prefix as prefix_mod
    layers, heads, dim, block = 2, 2, 8, 4
    block_bytes = 2 * layers * heads * dim * block * 4  # float32
    monkeypatch.setattr(prefix_mod, "IN_FLIGHT_BYTES", 3 * block_bytes)
    disk = prefix_mod.DiskTier(tmp_path, 1 << 30, "f" * 20, block, (layers, heads, dim, torch.float32))
    release, writing = threading.Event(), threading.Event()
    real_write = disk._write

    def slow_write(*a):  # the disk is slow: nothing is written until released
        writing.set()
        release.wait()
        real_write(*a)
    monkeypatch.setattr(disk, "_write", slow_write)
    blk = prefix_mod._Block([torch.zeros(1, heads, block, dim) for _ in range(layers)],
                            [torch.zeros(1, heads, block, dim) for _ in range(layers)], block_bytes)
    disk.save(b"k0", blk)
    writing.wait(timeout=60)  # the writer took the first block and is stuck writing it
    handed = []
    saver = threading.Thread(target=lambda: [handed.append(disk.save(bytes([i]), blk)) for i in range(1, 6)])
    saver.start()
    deadline = time.monotonic() + 120
    while len(handed) < 3 and time.monotonic() < deadline:  # however slow the machine: three fit the queue
        time.sleep(0.01)
    saver.join(timeout=1)
    assert saver.is_alive() and len(handed) == 3  # three blocks wait in the queue; the insert waits for room
    release.set()
    saver.join(timeout=60)
    disk.flush()
    assert not saver.is_alive() and disk.writes == 6 and disk.write_errors == 0
