"""Checks the native kernels share."""
from __future__ import annotations

import subprocess
import sys


def assert_failed_build_warns_once(module: str, tmp_path) -> None:
    """With no compiler, importing `infinigen.kernels.<module>` and asking `available()` twice prints one warning
    line on stderr (its first line only), returns False both times and raises nothing."""
    code = ("import torch.utils.cpp_extension as c\n"
            "def fail(*a, **k):\n    raise RuntimeError('no compiler found\\nsecond line')\n"
            "c.load = fail\n"
            f"from infinigen.kernels import {module} as f\n"
            "print(f.available(), f.available())\n")
    env = {"INFINIGEN_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"
    lines = [ln for ln in done.stderr.splitlines() if f"{module} kernel" in ln]
    assert len(lines) == 1 and "no compiler found" in lines[0] and "second line" not in done.stderr
