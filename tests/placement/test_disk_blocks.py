"""The disk tier in blocks (`placement.blocks.BlockedKVStore`): the same tokens as the in-memory store for
every policy, with and without a pool limit; a selection reads exactly the file units its slots lie in
(counted at the positioned reads themselves), the open block from memory; the file is written in whole
units; with an unlimited budget a block-selecting InfiniGen equals the dense full cache."""
from __future__ import annotations

import os

import pytest
import torch

from infinigen import runtime
from infinigen.placement import BlockedKVStore, Placement
from infinigen.placement import blocks as blocks_mod
from infinigen.policies import make_policy
from infinigen.selection import ALL

from support.offload import (B, GEN, PROMPT, FifoVictims, PlannedRandom, offload_policy, offload_prompts,
                             run_placed)


def _allocators():
    yield "fifo-local", FifoVictims
    from infinigen import pool
    for name in ("counter", "lru", "fifo"):
        yield f"pool-{name}", (lambda name=name: pool.make_pool(name))


def _block_policy(model, block, **kw):
    """InfiniGen choosing blocks of `block` slots (budget "layer"), random orthogonal skew."""
    mats = offload_policy("infinigen", model).matrices
    knobs = dict(preset="flat", dense_layers=(0,), min_fetch=0, budget="layer", block=block) | kw
    return make_policy("infinigen", **knobs).with_skew(mats)


def _make(name, model):
    if name == "infinigen-blocks":
        return _block_policy(model, 4)
    return offload_policy(name, model)


@pytest.mark.parametrize("policy", ["full", "h2o", "planned-random", "infinigen", "infinigen-blocks"])
@pytest.mark.parametrize("block", [4, 16])
def test_block_layout_same_tokens(tiny_llama, policy, block, tmp_path):
    _, model = tiny_llama
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), _make(policy, model))
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=block)
    pol = _make(policy, model)
    tokens, logits, sess = run_placed(model, pl, pol)
    assert isinstance(sess.store, BlockedKVStore)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)
    st = sess.store.stats
    # what is known a layer ahead is prefetched; InfiniGen's default query on this store is each layer's own
    # (`ahead_pays`), its selecting layers read at their attention
    on_demand = GEN * len(pol.selecting_layers(model.cfg)) if policy == "infinigen" else 0
    assert st.fetches == GEN * model.cfg.num_layers and st.on_demand == on_demand and st.stale == 0
    assert st.bytes_moved == st.blocks * sess.store.unit > 0
    assert os.listdir(tmp_path) == []  # the pool file had no name there


@pytest.mark.parametrize("threaded,prefetch", [(False, True), (True, False)])
def test_block_layout_inline_and_on_demand(tiny_llama, threaded, prefetch, tmp_path):
    _, model = tiny_llama
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), PlannedRandom())
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=4, threaded=threaded, prefetch=prefetch)
    tokens, logits, _ = run_placed(model, pl, PlannedRandom())
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alloc_name,alloc", list(_allocators()))
def test_block_layout_with_victims(tiny_llama, alloc_name, alloc, tmp_path):
    """A pool limit below the sequence: victims' rows are written in place in their blocks."""
    _, model = tiny_llama
    capacity = PROMPT + 4  # not a multiple of the block: the last block is partial
    ref_tokens, ref_logits, _ = run_placed(model, Placement("none"), PlannedRandom(), capacity=capacity,
                                           allocator=alloc())
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=8)
    tokens, logits, sess = run_placed(model, pl, PlannedRandom(), capacity=capacity, allocator=alloc())
    assert sess.store.capacity == capacity
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)


def test_unlimited_block_selection_is_dense(tiny_llama, tmp_path):
    """Exactness on the block layout: InfiniGen choosing blocks with no threshold and no cap reads every
    entry, and its logits are those of the full cache in fast memory."""
    _, model = tiny_llama
    _, ref_logits, _ = run_placed(model, Placement("none"), make_policy("full"))
    pol = _block_policy(model, 4, alpha=1e9, max_fetch_ratio=1.0)
    _, logits, sess = run_placed(model, Placement("disk", pool_dir=str(tmp_path), disk_block=4), pol)
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=0)


class _CountIO:
    """Every positioned read and write of the blocks module: (offset, bytes)."""

    def __init__(self, monkeypatch):
        self.reads, self.writes = [], []
        preadv, pwrite = os.preadv, os.pwrite

        def counting_preadv(fd, bufs, offset):
            n = preadv(fd, bufs, offset)
            self.reads.append((offset, n))
            return n

        def counting_pwrite(fd, data, offset):
            n = pwrite(fd, data, offset)
            self.writes.append((offset, n))
            return n
        monkeypatch.setattr(blocks_mod.os, "preadv", counting_preadv)
        monkeypatch.setattr(blocks_mod.os, "pwrite", counting_pwrite)
        monkeypatch.setattr(blocks_mod, "native_reads", False)  # every read through os.preadv, counted


def test_reads_exactly_the_named_blocks(tiny_llama, tmp_path, monkeypatch):
    """Per decoding step, the units read from the file are exactly those holding a selected valid slot, less
    the open blocks (in memory): counted at the reads. Writes are whole units at unit boundaries."""
    _, model = tiny_llama
    pol = _block_policy(model, 4)
    tokens, pad = offload_prompts()
    want = [0]

    class Units(runtime.Listener):  # the units each layer's selection names, as it reads
        def on_select(self, layer, rows, keep, s):
            store = s.store
            n, bs = store.length[layer], store.block
            if keep is ALL:  # every used slot's block (padding's too: one read per head)
                chosen = torch.ones(store.batch, store.kv_heads, n, dtype=torch.bool)
            else:
                chosen = store.valid[layer][:, :, :n] & keep[:, :, 0, :n]
            nb = -(-n // bs)
            per_block = torch.nn.functional.pad(chosen, (0, nb * bs - n)).view(store.bh, nb, bs).any(-1)
            if n < store.capacity:
                per_block[:, n // bs:] = False  # the open block is in memory
            want[0] += int(per_block.sum())

    io = _CountIO(monkeypatch)
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=4, threaded=False)
    sess = pl.new_session(model, B, PROMPT + GEN, pol, listeners=[Units()])
    store = sess.store
    logits = runtime.prefill(model, tokens, sess, pad)
    store.stats.reset()
    io.reads.clear()
    for _ in range(GEN):
        logits = runtime.decode(model, logits.argmax(-1), sess)
    read = sum(n for _, n in io.reads)
    assert read == want[0] * store.unit == store.stats.bytes_moved
    assert all(off % store.unit == 0 and n % store.unit == 0 for off, n in io.reads)
    assert all(off % store.unit == 0 and n == store.unit for off, n in io.writes[-store.bh:])
    # and a real subset: fewer units than the used layers hold
    whole = GEN * sum(store.bh * -(-n // store.block) for n in store.length)
    assert 0 < read < whole * store.unit
    pl.close(sess)


def _read_bytes() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def test_disk_reads_match_the_blocks(tiny_llama, tmp_path):
    """Counted by the kernel (/proc/self/io read_bytes) with the file's pages dropped from the page cache:
    a decoding step reads from the device at most 1.5x the bytes of the units it names (no readahead)."""
    _, model = tiny_llama
    pol = _block_policy(model, 4)
    tokens, pad = offload_prompts()
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=4, threaded=False)
    sess = pl.new_session(model, B, PROMPT + GEN, pol)
    store = sess.store
    logits = runtime.prefill(model, tokens, sess, pad)

    def drop():
        os.fsync(store.fd)
        os.posix_fadvise(store.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    drop()
    before = _read_bytes()
    os.pread(store.fd, 4096, 0)
    if _read_bytes() == before:
        pl.close(sess)
        pytest.skip("the pool's filesystem does no block I/O here (tmpfs?): read_bytes does not move")
    total, moved = 0, 0
    for _ in range(4):
        drop()
        store.stats.reset()
        before = _read_bytes()
        logits = runtime.decode(model, logits.argmax(-1), sess)
        total += _read_bytes() - before
        moved += store.stats.bytes_moved
    pl.close(sess)
    assert moved > 0 and moved <= total <= 1.5 * moved


@pytest.mark.parametrize("kw,msg", [(dict(disk_block=-1), "disk_block"), (dict(disk_block=1.5), "disk_block"),
                                    (dict(disk_block=4, kv_offload="cpu"), "disk tier"),
                                    (dict(disk_block=4, row_cache_bytes=1 << 20), "row cache")])
def test_bad_disk_block(kw, msg):
    from infinigen.errors import ArgumentError
    kw = {"kv_offload": "disk"} | kw
    with pytest.raises(ArgumentError, match=msg):
        Placement(**kw)


def test_unwritable_pool_dir_is_a_user_error(tiny_llama, tmp_path):
    from infinigen.errors import UserError
    _, model = tiny_llama
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is writable")
        with pytest.raises(UserError, match="cannot create a KV pool file in"):
            Placement("disk", pool_dir=str(folder), disk_block=4).new_session(model, B, 40, make_policy("full"))
    finally:
        folder.chmod(0o700)


def test_pool_folder_removed_mid_run(tiny_llama, tmp_path):
    """The pool file has no name: removing its folder while a request decodes changes nothing."""
    import shutil
    _, model = tiny_llama
    ref_tokens, _, _ = run_placed(model, Placement("none"), PlannedRandom())
    folder = tmp_path / "kv"
    pl = Placement("disk", pool_dir=str(folder), disk_block=4)
    tokens, pad = offload_prompts()
    sess = pl.new_session(model, B, PROMPT + GEN, PlannedRandom())
    logits = runtime.prefill(model, tokens, sess, pad)
    shutil.rmtree(folder)
    out = []
    for _ in range(GEN):
        out.append(logits.argmax(-1))
        logits = runtime.decode(model, out[-1], sess)
    pl.close(sess)
    assert torch.equal(torch.stack(out, 1), ref_tokens)


@pytest.mark.parametrize("policy", ["h2o", "infinigen-blocks"])
def test_teacher_forced_on_the_block_layout(tiny_llama, policy, tmp_path):
    """Teacher-forced scoring (perplexity) reads through the same store methods: the same scores as in RAM."""
    _, model = tiny_llama
    tokens = offload_prompts(batch=2, length=30)[0]
    ref = runtime.teacher_forced(model, tokens, 20, Placement().new_session(model, 2, 30, _make(policy, model)))
    pl = Placement("disk", pool_dir=str(tmp_path), disk_block=4)
    sess = pl.new_session(model, 2, 30, _make(policy, model))
    got = runtime.teacher_forced(model, tokens, 20, sess)
    pl.close(sess)
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)
