"""The disk tier fails early and in one line (issue 9, item 5): the pool file is preallocated, so a full
filesystem is a UserError (CLI exit 2) before any work, never a SIGBUS from a write through a sparse
mapping; a pool smaller than the prompt is refused when the arguments are checked."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

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
