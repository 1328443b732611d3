"""Memory tiers. The fast tier is where compute reads (GPU memory on CUDA, RAM otherwise); the slow tier
holds the KV pool: pinned host memory behind a GPU ("cpu"), or a memory-mapped file ("disk") for
CPU-only hosts and contexts beyond RAM. "none" keeps everything in the fast tier (the plain KVStore).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..errors import UserError

KINDS = ("none", "cpu", "disk")


def _remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _preallocate(path: str, nbytes: int) -> None:
    """Reserve the file's blocks now. A sparse file gets blocks only when a page is first written, and a
    write through the mapping into a full filesystem is a SIGBUS that kills the process mid-run; with the
    blocks reserved up front, a full disk is an error here, before any work."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        fd = -1
        os.unlink(path)
        free = shutil.disk_usage(os.path.dirname(path)).free
        raise UserError(f"cannot reserve {nbytes} bytes for the KV pool in {os.path.dirname(path)} "
                        f"({free} bytes free): {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)


class SlowTier:
    """Allocates slow-tier tensors and accounts for their bytes.

    "cpu": host memory, pinned when the fast tier is a GPU (so copies can run asynchronously on a copy
    stream); on a CPU-only host it is just another RAM buffer. "disk": one file per tensor in a fresh
    directory under `directory` (default: the system temp dir), mapped with `torch.from_file` (shared
    mapping: writes go to the file, reads come through the page cache). The directory is removed by
    `close()`, when the tier is garbage collected, or at interpreter exit, whichever comes first.
    """

    def __init__(self, kind: str = "cpu", fast_device: torch.device | str = "cpu", directory: str | os.PathLike | None = None):
        if kind not in ("cpu", "disk"):
            raise UserError(f"unknown slow tier {kind!r}; choose cpu or disk")
        self.kind = kind
        self.fast = torch.device(fast_device)
        self.pinned = kind == "cpu" and self.fast.type == "cuda"
        self.nbytes = 0
        self.tensors: list[torch.Tensor] = []
        self.dir: str | None = None
        if kind == "disk":
            base = Path(directory).expanduser() if directory else Path(tempfile.gettempdir())
            try:
                base.mkdir(parents=True, exist_ok=True)
                self.dir = tempfile.mkdtemp(prefix="infinigen-kv-", dir=base)
            except OSError as e:
                raise UserError(f"cannot create the KV pool directory under {base}: {e}")
            self._cleanup = weakref.finalize(self, _remove, self.dir)  # also runs at interpreter exit

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, name: str = "t") -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        if self.kind == "disk":
            path = os.path.join(self.dir, f"{name}-{len(self.tensors)}.bin")
            nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
            _preallocate(path, nbytes)
            try:
                t = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)[:numel].view(shape)
            except RuntimeError as e:
                raise UserError(f"cannot map a {nbytes} byte KV pool file in {self.dir}: {e}")
        else:
            t = torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        self.tensors.append(t)
        self.nbytes += t.numel() * t.element_size()
        return t

    def files_bytes(self) -> int:
        """Bytes of the pool files on disk (apparent size); 0 for host memory."""
        if self.kind != "disk" or not self.dir or not os.path.isdir(self.dir):
            return 0
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in os.listdir(self.dir))

    def close(self) -> None:
        self.tensors.clear()  # drop the mappings before the files go
        if self.kind == "disk":
            self._cleanup()

    def describe(self) -> str:
        if self.kind == "disk":
            return f"disk (memory-mapped files in {self.dir})"
        return "pinned host memory" if self.pinned else "host memory"


def fast_device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "CPU"
