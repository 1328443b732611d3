"""benchmarks/cuda_fused_select.py without a GPU: its smoke run under TRITON_INTERPRET=1 on CPU checks every
shape, times every row, prints the table and writes the JSON it promises; asked for CUDA where there is none it
says so in one line and exits 2."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from support.cli import REPO, subprocess_env

SCRIPT = REPO / "benchmarks" / "cuda_fused_select.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@needs_triton
def test_smoke_run_checks_times_and_writes_json(tmp_path):
    env = subprocess_env(TRITON_INTERPRET="1", OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke"], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 2 and all(" ok " in line for line in table[1:])  # the head, one row per shape
    got = json.loads((tmp_path / "cuda_fused_select.json").read_text())
    assert len(got["results"]) == 2
    for row in got["results"]:
        assert row["check"]["ok"] and row["check"]["float32"]["splits=3"]["out"] <= 1e-5
        # the tensor-core dots of a 16-bit cache (float16 under the interpreter) and the IEEE ones on bfloat16
        assert row["check"]["float16"]["out"] <= 1e-2 and row["check"]["bfloat16_ieee"]["out"] <= 1e-2
        assert all(row["time"][k] > 0 for k in ("kernel_ms", "torch_ms", "dense_sdpa_ms"))
    assert set(got["results"][0]["time"]["splits_ms"]) == {"1", "2", "4", "8", "16", "32"}
    assert len(got["results"][0]["time"]["launch_ms"]) == 9


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_no_cuda_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, str(SCRIPT)], env=subprocess_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "CUDA" in r.stderr, r.stderr
