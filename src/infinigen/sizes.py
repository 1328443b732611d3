"""The one parser of byte sizes given by a user ("2G", "512M", "1.5GiB", "1000000"): every size flag of every
command and `membound.parse_limit` read their values here (ground floor: no torch, the CLI starts fast)."""
from __future__ import annotations

import re
from decimal import Decimal

from .errors import UserError

MAX_BYTES = 2 ** 63 - 1  # a size goes to torch, mmap and the OS as a signed 64-bit count
UNITS = "kmgtpe"  # powers of 1024, with or without "i" and "B": 2G = 2GiB = 2GB = 2 * 1024**3
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:([kmgtpe])i?)?b?\s*")


def parse_bytes(text: str | None, name: str, zero: bool = False) -> int | None:
    """`text` as a number of bytes (None stays None); `name` is the option, for the error. A positive whole
    number of bytes at most MAX_BYTES; with `zero`, "0" is allowed too (it turns the thing off). Anything
    else (garbage, a sign, inf, nan, a value beyond 64 bits) is a UserError."""
    if text is None:
        return None
    m = _SIZE.fullmatch(str(text).lower())
    if not m:
        raise UserError(f"--{name} expects a size like 2G, 512M or 1000000, got {text!r}")
    if len(m.group(1)) > 40:  # beyond any 64-bit size whatever its unit; Decimal would read it exactly, slowly
        raise UserError(f"--{name} {_short(text)} is too large: at most {MAX_BYTES} bytes (2**63 - 1)")
    value = int(Decimal(m.group(1)) * 1024 ** (UNITS.index(m.group(2)) + 1 if m.group(2) else 0))
    if value > MAX_BYTES:
        raise UserError(f"--{name} {_short(text)} is too large: at most {MAX_BYTES} bytes (2**63 - 1)")
    if value < 1 and not (zero and value == 0 and Decimal(m.group(1)) == 0):
        raise UserError(f"--{name} must be {'0 (off) or ' if zero else ''}at least 1 byte, got {text!r}")
    return value


def _short(text) -> str:
    """`text` for an error line: a value of hundreds of digits is cut to its ends."""
    text = str(text).strip()
    return text if len(text) <= 24 else f"{text[:10]}...{text[-10:]} ({len(text)} characters)"
