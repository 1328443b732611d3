"""The disk tier fails early and in one line: the pool file is preallocated, so a full
filesystem is a UserError (CLI exit 2) before any work, never a SIGBUS from a write through a sparse
mapping; a pool smaller than the prompt is refused when the arguments are checked."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from infinigen import runtime
from infinigen.errors import UserError
from infinigen.placement import SlowTier


def test_pool_file_is_preallocated(tmp_path):
    tier = SlowTier("disk", directory=tmp_path)
    t = tier.empty((64, 1024), torch.float32)
    (st,) = tier.file_stats()  # the file has no name in tier.dir: nothing is left there if the run is killed
    assert st.st_size == 64 * 1024 * 4
    assert st.st_blocks * 512 >= st.st_size  # blocks reserved, not a sparse file
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 64 * 1024
    tier.close()


def test_no_space_is_a_user_error(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    tier = SlowTier("disk", directory=tmp_path)
    with pytest.raises(UserError, match="cannot reserve 4096 bytes.*No space left"):
        tier.empty((1024,), torch.float32)
    assert os.listdir(tier.dir) == []  # the half-made file is gone
    tier.close()


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs, filled up: the real ENOSPC path. Needs root (mount)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:  # fill it up: no room is left for a pool file
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_filesystem_in_the_tier(tiny_fs):
    tier = SlowTier("disk", directory=tiny_fs)
    with pytest.raises(UserError, match="cannot reserve"):
        tier.empty((1 << 16,), torch.float32)
    tier.close()


def test_full_filesystem_in_the_cli(tiny_fs, tiny_checkpoint, capsys):
    from infinigen.cli import main
    code = main(["bench", "-m", str(tiny_checkpoint), "--kv-offload", "disk", "--pool-dir", str(tiny_fs),
                 "--policy", "full", "--no-ideal", "--no-transformers", "--prompt-len", "40", "--gen-len", "3",
                 "--batch-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("infinigen: error: cannot reserve")


def test_pool_smaller_than_the_prompt(tiny_checkpoint, capsys):
    from infinigen.cli import main
    base = ["bench", "-m", str(tiny_checkpoint), "--prompt-len", "40", "--gen-len", "3", "--batch-size", "2",
            "--kv-offload", "cpu", "--no-transformers"]
    assert main(base + ["--capacity", "39"]) == 2
    assert "cannot hold the 40-token prompt" in capsys.readouterr().err
    assert main(base + ["--pool-bytes", "4000"]) == 2
    assert "fewer than the prompt (40 tokens)" in capsys.readouterr().err


def test_memory_bound_caps_the_page_cache(tmp_path):
    """A process in the bound that reads a file 3x the limit ends with at most the limit charged."""
    import sys
    from infinigen.membound import MemoryBound
    limit = 32 << 20
    try:
        mb = MemoryBound(limit)
    except UserError as e:
        pytest.skip(f"no memory bound here: {e}")
    with mb:
        assert str(limit // 2**20) in mb.describe() and mb.info()["mechanism"] == mb.mechanism
        if mb.group is None:
            pytest.skip(f"{mb.mechanism}: no group to inspect")
        path = tmp_path / "big"
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20) * 96)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read below must fill the cache itself
        os.close(fd)
        read = (f"b = bytearray(1 << 20)\nfor _ in range(2):\n    f = open({str(path)!r}, 'rb', buffering=0)\n"
                f"    while f.readinto(b): pass\n")  # small reads: the group's memory is page cache
        code = mb.run([sys.executable, "-c", read])
        assert code == 0
        st = mb.stats()
        assert 0 < st["file"] <= limit and st["peak"] <= limit


def test_bench_under_a_memory_limit(tiny_checkpoint, tmp_path):
    """`infinigen bench --memory-limit` re-runs itself inside the bound and says which one in its JSON."""
    import json
    from infinigen.cli import main
    from infinigen.membound import MemoryBound
    try:
        MemoryBound(512 << 20).close()
    except UserError as e:
        pytest.skip(f"no memory bound here: {e}")
    out = tmp_path / "b.json"
    code = main(["bench", "-m", str(tiny_checkpoint), "--kv-offload", "disk", "--policy", "full", "--no-ideal",
                 "--no-transformers", "--prompt-len", "16", "--gen-len", "3", "--batch-size", "1",
                 "--memory-limit", "512M", "--json", str(out)])
    assert code == 0
    mb = json.loads(out.read_text())["settings"]["memory_bound"]
    assert mb["limit_bytes"] == 512 << 20 and mb["mechanism"] in ("cgroup2", "cgroup1", "systemd-run")
    assert main(["bench", "-m", str(tiny_checkpoint), "--memory-limit", "lots"]) == 2


# ---- a selection on few pages reads those pages, not the layer ------------------------------------------------
def _few_pages_share(store, layer, keep):
    """Share of the used layer's file pages the rows `keep` selects lie on (the store's own measure)."""
    from infinigen.placement.transfer import touched_page_share
    n = store.length[layer]
    sel = keep[:, :, :n] & store.valid[layer][:, :, :n]
    b, h, s = sel.nonzero(as_tuple=True)
    rows = s * store.bh + b * store.kv_heads + h  # slot-major rows, (b, h) within a slot
    return touched_page_share(rows, store.layout.row_bytes, n * store.bh)  # plain layout: one plane


def test_disk_selection_on_few_pages_reads_only_its_rows(make_tiny, tmp_path):
    """At the default disk_bulk_share (0.25), a selection whose rows lie on under a quarter of the layer's
    file pages (attention sinks and a recent window over a 200-token cache, rows of 256 B: a page holds 4
    slots of 2 sequences x 2 KV heads) is read row by row: the bytes read at the tier (every aten read of
    the pool's storage, counted by `SlowReads`) and the store's own `bytes_moved` are those of the selected
    rows, a small part of the used layers, and the tokens are the in-memory store's. A store that always
    read the whole layer (`bulk` forced on) reads every used row and fails."""
    from support.offload import SlowReads

    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    _, model = make_tiny("llama", head_dim=64)  # 256 B rows in float32
    assert model.cfg.head_dim == 64
    batch, prompt, gen = 2, 200, 6
    tokens = torch.randint(3, model.cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(4))

    def policy():
        return make_policy("streaming", sinks=2, window=8)

    ref = Placement().new_session(model, batch, prompt + gen, policy())
    ref_logits = [runtime.prefill(model, tokens, ref)]
    pl = Placement("disk", pool_dir=str(tmp_path), threaded=False)  # inline: SlowReads sees the fetches
    assert pl.disk_bulk_share == 0.25  # the default is what this test is about
    pol = policy()
    sess = pl.new_session(model, batch, prompt + gen, pol)
    store = sess.store
    row = 2 * store.layout.row_bytes  # a key and a value vector
    want, shares = [0], []
    inner = pol.keep

    def keep(layer, rows, s):
        answer = inner(layer, rows, s)
        if rows.in_store:  # a decoding step (one row): the selection over the store's slots
            mask = answer[:, :, 0]
            n = store.length[layer]
            want[0] += int((mask[:, :, :n] & store.valid[layer][:, :, :n]).sum()) * row
            shares.append(_few_pages_share(store, layer, mask))
        return answer
    object.__setattr__(pol, "keep", keep)  # policies are frozen: a test wrapper all the same
    logits = runtime.prefill(model, tokens, sess)
    assert torch.allclose(logits, ref_logits[0], atol=1e-5, rtol=0)
    store.stats.reset()
    measured, whole = 0, 0
    for _ in range(gen):
        t = logits.argmax(-1)
        whole += sum(store.bh * n * row for n in store.length)
        with SlowReads(store) as reads:
            logits = runtime.decode(model, t, sess)
        measured += reads.bytes
        ref_logits.append(runtime.decode(model, t, ref))
        assert torch.allclose(logits, ref_logits[-1], atol=1e-5, rtol=0)
    st = store.stats
    pl.close(sess)
    assert len(shares) == gen * model.cfg.num_layers and max(shares) < 0.25  # the premise: few pages each time
    assert measured == want[0] == st.bytes_moved  # the selected rows, counted at the tier
    assert measured < 0.25 * whole and st.bulk == 0


def test_disk_store_reads_scattered_page_rows(tmp_path):
    """The store alone, rows of one page each (head_dim 1024, float32): four scattered slots of 64 touch
    1/16 of the layer's pages, so `hand_rows` reads those rows (counted at the tier and in `bytes_moved`),
    never the whole used layer, and returns exactly the rows written there."""
    from support.offload import SlowReads

    from infinigen.placement import OffloadedKVStore, SlowTier
    from infinigen.placement.transfer import PAGE, touched_page_share
    layers, batch, heads, cap, d = 2, 1, 2, 64, 1024
    store = OffloadedKVStore(layers, batch, heads, cap, d, torch.float32, tier=SlowTier("disk", directory=tmp_path),
                             threaded=False)
    assert store.bulk_share == 0.25 and store.layout.row_bytes == PAGE  # plain layout: one plane
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, batch, heads, cap, d, generator=g)
    for layer in range(layers):
        store.write_prompt(layer, k, v, torch.ones(batch, cap, dtype=torch.bool), torch.arange(cap)[None])
    idx = torch.tensor([[[3, 17, 40, 60], [5, 22, 41, 63]]])  # [B, Hkv, n]: per KV head its own slots
    rows = idx * store.bh + torch.arange(heads)[None, :, None]  # slot-major rows (batch 1)
    assert touched_page_share(rows.flatten(), PAGE, cap * store.bh) == 1 / 16
    keep = torch.zeros(batch, heads, cap, dtype=torch.bool).scatter_(2, idx, True)
    sel = store.select_rows(1, keep, store.valid[1][:, :, :cap])
    store.stats.reset()
    with SlowReads(store) as reads:
        handed = store.hand_rows(1, sel)
    expect = 2 * idx.numel() * PAGE
    assert reads.bytes == store.stats.bytes_moved == expect and store.stats.bulk == 0
    assert expect * 16 == 2 * cap * store.bh * PAGE  # the whole used layer is 16 times as much
    pick = idx[..., None].expand(-1, -1, -1, d)  # packed per batch row: KV head 0's rows, then KV head 1's
    assert torch.equal(handed.keys[handed.rows].view(k.gather(2, pick).shape), k.gather(2, pick))
    assert torch.equal(handed.values[handed.rows].view(v.gather(2, pick).shape), v.gather(2, pick))
    store.close()
    assert os.listdir(tmp_path) == []
