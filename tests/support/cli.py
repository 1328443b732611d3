"""The checkout's root, and how bad input must be reported."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def one_line_error(code, err, *needles):
    """Bad input: exit code 2 and one line on stderr, `infinigen: error: ...` naming each needle."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("infinigen: error: ") and "Traceback" not in err
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]
