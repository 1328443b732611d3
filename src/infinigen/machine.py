"""What this machine's CPU is and can do, read once from /proc/cpuinfo (Linux; elsewhere: nothing known).

The one reader of that file: the precision choice (bfloat16 where the CPU multiplies it natively), the
benchmark report's machine line, and what keys machine-specific caches (the measured crossing, the fused
kernel's build) all ask here.
"""
from __future__ import annotations

import functools
import platform

CPUINFO = "/proc/cpuinfo"


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo ({} where it cannot be read)."""
    out: dict[str, str] = {}
    try:
        with open(CPUINFO) as f:
            for line in f:
                if not line.strip():
                    if out:
                        break  # the first processor's block is enough: every core reports the same model
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    return out


def cpu_name() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) ..."); where /proc/cpuinfo has none, what `platform` says."""
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags ("avx512_bf16", "amx_tile", ...): empty where they cannot be read."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())
