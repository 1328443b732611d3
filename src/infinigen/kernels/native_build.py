"""Native kernels built on first use with torch's cpp_extension into the cache (`cache_dir()/kernels/<name>-<key>`,
keyed by torch's version, the machine, the CPU's flags and the source, so a shared cache never serves a build for
another CPU or another source), one builder at a time; -O3 -march=native and OpenMP (`at::parallel_for`)."""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

from ..machine import cpu_flags
from ..paths import writable_cache


def build_key(source: Path) -> str:
    """A short hash of what a build of `source` depends on."""
    flags = " ".join(sorted(cpu_flags()))
    text = f"{torch.__version__}|{platform.machine()}|{flags}|{source.read_bytes().hex()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_library(name: str, source: Path) -> bool:
    """Build (once per cache) and load `source`, a library registering torch ops (TORCH_LIBRARY): whether it
    loaded. A failure is one warning line on stderr; the caller keeps its torch path."""
    try:
        from torch.utils import cpp_extension

        build = writable_cache(f"kernels/{name}-{build_key(source)}")
        with open(build / "build.flock", "w") as held:
            # a `lock` file of cpp_extension's that a killed builder left would be waited on forever: holding
            # this lock (which the system drops when its holder dies), nobody else is building
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            copy = _source_in(build, source)
            cpp_extension.load(name=f"infinigen_{name}", sources=[str(copy)], build_directory=str(build),
                               extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
        return True
    except Exception as e:  # noqa: BLE001 - any build or load failure means: the torch path
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"infinigen: the native {name} kernel is unavailable ({first[:200]}); using torch's", file=sys.stderr)
        return False


def _source_in(build: Path, source: Path) -> Path:
    """The source copied into its build folder (keyed by its bytes): every checkout sharing the cache names one
    path in the build's commands, so none rebuilds what another built."""
    copy = build / source.name
    if not copy.is_file() or copy.read_bytes() != source.read_bytes():
        partial = build / f"{source.name}.partial"
        partial.write_bytes(source.read_bytes())
        os.replace(partial, copy)
    return copy
