"""An interrupted or killed run leaves nothing behind: `analyze` writes its folder whole (an interrupt leaves
no figure without its report, and an earlier report as it was), a killed writer's partial folder is removed
by the next run, and a disk pool has no name a killed run could leave."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from support.cli import cli_process, subprocess_env


# ---- analyze: its folder written whole ----------------------------------------------------------------------------
def test_interrupted_analyze_leaves_no_figure_without_its_report(cli, tiny_checkpoint, text_file, tmp_path,
                                                                  monkeypatch):
    import infinigen.eval.analyze as an
    out = tmp_path / "results" / "analyze"
    args = ["analyze", "--model", tiny_checkpoint, "--text", text_file, "--tokens", "64", "--prefill", "16",
            "--only", "table1,fig5", "--knob", "skew=false", "--out", out]
    real = an.prompt_statistics

    def interrupted(*a, **k):  # Ctrl-C after table 1's figure was saved
        raise KeyboardInterrupt
    monkeypatch.setattr(an, "prompt_statistics", interrupted)
    code, _, err = cli(*args)
    assert code == 130 and "Traceback" not in err
    assert list((tmp_path / "results").iterdir()) == []  # no PNG, no half-made folder
    monkeypatch.setattr(an, "prompt_statistics", real)
    code, _, err = cli(*args)
    assert code == 0, err
    assert {"analyze.md", "table1_block_similarity.png", "fig5_keys_for_90pct.png"} <= {p.name for p in out.iterdir()}
    first = (out / "analyze.md").read_text()
    # into an existing folder: an interrupted run leaves the earlier report and figures as they were
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(an, "prompt_statistics", interrupted)
    assert cli(*args)[0] == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["analyze"] and "Table 1" in first


def test_a_killed_writers_partial_folder_is_removed(cli, tiny_checkpoint, text_file, tmp_path):
    from infinigen.commands.options import PARTIAL_FOLDER
    results = tmp_path / "results"
    dead = results / f"{PARTIAL_FOLDER}999999999-analyze-x"  # no such pid: a killed analyze
    live = results / f"{PARTIAL_FOLDER}{os.getpid()}-analyze-y"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "table1_block_similarity.png").write_bytes(b"png")
    code, _, err = cli("analyze", "--model", tiny_checkpoint, "--text", text_file, "--tokens", "64", "--prefill", "16",
                       "--only", "table1", "--out", results / "analyze")
    assert code == 0, err
    assert not dead.exists() and live.exists()


# ---- the disk pool: nothing named that a kill could leave -----------------------------------------------------------
def _fds_into(pid: int, folder: Path) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder) + "/"):
            out.append(target)
    return out


def test_sigkill_leaves_no_disk_pool(tiny_checkpoint, text_file, tmp_path):
    """A real run, killed with SIGKILL while its disk pool is open: the pool folder holds nothing."""
    pool = tmp_path / "pool"
    p = subprocess.Popen(cli_process("ppl", "--model", tiny_checkpoint, "--text", text_file, "--ctx", "128",
                                      "--prefill", "16", "--windows", "8", "--policy", "h2o", "--kv-offload", "disk",
                                      "--pool-dir", pool),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=subprocess_env())
    try:
        deadline = time.monotonic() + 120
        while not (pool.is_dir() and _fds_into(p.pid, pool)):
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run ended before its pool was seen: {p.stderr.read().decode()[-500:]}")
            time.sleep(0.02)
        held = _fds_into(p.pid, pool)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert held and all(t.endswith("(deleted)") or "/#" in t for t in held), held  # no name, even while in use
    assert p.returncode == -signal.SIGKILL
    assert os.listdir(pool) == []


def test_named_pool_files_when_there_is_no_o_tmpfile(tmp_path, monkeypatch):
    """Without O_TMPFILE the pool file is named (with our pid) until it is mapped, then unlinked; names of
    dead writers are removed when the next tier is made, a live writer's are left alone."""
    from infinigen.placement import tiers
    monkeypatch.setattr(tiers, "_USE_TMPFILE", False)
    dead = tmp_path / f"{tiers.POOL_PREFIX}999999999-abc.bin"
    live = tmp_path / f"{tiers.POOL_PREFIX}{os.getpid()}-def.bin"
    for f in (dead, live):
        f.write_bytes(b"\0" * 4096)
    tier = tiers.SlowTier("disk", directory=tmp_path)
    assert not dead.exists() and live.exists()
    t = tier.empty((256, 16), torch.float32)
    t.fill_(2.5)
    assert sorted(os.listdir(tmp_path)) == [live.name]  # mapped, so unlinked already
    assert float(t.sum()) == 2.5 * 256 * 16 and tier.files_bytes() == 256 * 16 * 4
    tier.close()
