"""The checkout's root, how a test starts the CLI as a process, and how bad input must be reported."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def subprocess_env(**extra) -> dict:
    """The environment of a CLI process started by a test: one thread, this checkout's package."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), **extra}


def console(*argv) -> list[str]:
    """The command line of the console script `infinigen ARGV...` beside this Python (else `python -m`)."""
    exe = Path(sys.executable).with_name("infinigen")
    return ([str(exe)] if exe.exists() else [sys.executable, "-m", "infinigen.cli"]) + [str(a) for a in argv]


def cli_process(*argv) -> list[str]:
    """The command line of `infinigen ARGV...` run by this Python."""
    return [sys.executable, "-m", "infinigen.cli", *[str(a) for a in argv]]


def one_line_error(code, err, *needles):
    """Bad input: exit code 2 and one line on stderr, `infinigen: error: ...` naming each needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("infinigen: error: ") and "Traceback" not in err
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]
