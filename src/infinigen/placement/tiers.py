"""Memory tiers. The fast tier is where compute reads (GPU memory on CUDA, RAM otherwise); the slow tier
holds the KV pool: pinned host memory behind a GPU ("cpu"), or a memory-mapped file ("disk") for
CPU-only hosts and contexts beyond RAM. "none" keeps everything in the fast tier (the plain KVStore).
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from ..errors import UserError

KINDS = ("none", "cpu", "disk")


POOL_PREFIX = "infinigen-kv-"  # + pid: a named pool file (where O_TMPFILE is missing), until it is mapped
_USE_TMPFILE = hasattr(os, "O_TMPFILE")  # Linux: a file with no name at all


def _close_all(fds: list[int]) -> None:
    while fds:
        try:
            os.close(fds.pop())
        except OSError:
            pass


def _pool_file(folder: str) -> tuple[int, str, bool]:
    """A new, empty file in `folder` that no one else can reach, and nothing on disk will outlive: (fd, a
    path that opens it, whether that path is a name in `folder` to unlink once the file is mapped).
    O_TMPFILE gives an unnamed file (opened again through /proc/self/fd); elsewhere a named one, whose
    name holds our pid so that a run killed before the unlink is cleaned up by the next one."""
    if _USE_TMPFILE:
        try:
            fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
            return fd, f"/proc/self/fd/{fd}", False
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise  # not "unsupported here": permissions, a full disk...
    fd, path = tempfile.mkstemp(prefix=f"{POOL_PREFIX}{os.getpid()}-", suffix=".bin", dir=folder)
    return fd, path, True


def _preallocate(fd: int, nbytes: int, folder: str) -> None:
    """Reserve the file's blocks now. A sparse file gets blocks only when a page is first written, and a
    write through the mapping into a full filesystem is a SIGBUS that kills the process mid-run; with the
    blocks reserved up front, a full disk is an error here, before any work."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        free = shutil.disk_usage(folder).free
        raise UserError(f"cannot reserve {nbytes} bytes for the KV pool in {folder} "
                        f"({free} bytes free): {e.strerror or e}") from None


def pool_folder(directory: str | os.PathLike | None) -> Path:
    """The disk tier's folder (default: the system temp dir), made if missing; a UserError naming it where it
    cannot be made or is not a folder."""
    base = Path(directory).expanduser() if directory else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the KV pool directory {base}: {e.strerror or e}")
    if not base.is_dir():
        raise UserError(f"the KV pool directory {base} is not a folder")
    return base


def check_pool_folder(directory: str | os.PathLike | None) -> None:
    """Before any work: the folder can hold a pool file (one is made and closed at once, leaving nothing)."""
    base = pool_folder(directory)
    try:
        fd, path, named = _pool_file(str(base))
    except OSError as e:
        raise UserError(f"cannot create a KV pool file in {base}: {e.strerror or e}")
    os.close(fd)
    if named:
        os.unlink(path)


class SlowTier:
    """Allocates slow-tier tensors and accounts for their bytes.

    "cpu": host memory, pinned when the fast tier is a GPU (so copies can run asynchronously on a copy
    stream); on a CPU-only host it is just another RAM buffer. "disk": one file per tensor in `directory`
    (default: the system temp dir), mapped with `torch.from_file` (shared mapping: writes go to the file,
    reads come through the page cache). The files have no name: unnamed from the start (O_TMPFILE) or
    unlinked as soon as they are mapped, so a run that is killed (SIGKILL, the OOM killer) leaves nothing
    behind; the kernel frees the blocks when the mapping and `fds` (kept for `files_bytes`) are gone.
    Named leftovers of killed runs (only where O_TMPFILE is missing) are removed when a tier is made.
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
        self.fds: list[int] = []  # the disk tier's open files, one per tensor
        if kind == "disk":
            from ..paths import remove_dead_owners
            base = pool_folder(directory)
            remove_dead_owners(base, POOL_PREFIX)
            self.dir = str(base)
            self._cleanup = weakref.finalize(self, _close_all, self.fds)  # also runs at interpreter exit

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, name: str = "t") -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        if self.kind == "disk":
            nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
            try:
                fd, path, named = _pool_file(self.dir)
            except OSError as e:
                raise UserError(f"cannot create a KV pool file in {self.dir}: {e.strerror or e}")
            try:
                _preallocate(fd, nbytes, self.dir)
                t = torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)[:numel].view(shape)
            except RuntimeError as e:
                os.close(fd)
                raise UserError(f"cannot map a {nbytes} byte KV pool file in {self.dir}: {e}")
            except BaseException:
                os.close(fd)
                raise
            finally:
                if named:  # the mapping keeps the data; the name would only outlive a killed run
                    os.unlink(path)
            self.fds.append(fd)
        else:
            t = torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        self.tensors.append(t)
        self.nbytes += t.numel() * t.element_size()
        return t

    def file(self, nbytes: int) -> int:
        """Disk tier: a new unnamed pool file of `nbytes` bytes, reserved now, read and written by the caller
        with positioned reads and writes (no mapping); its descriptor, closed with the tier. The kernel is
        told the reads are random (no readahead around them)."""
        if self.kind != "disk":
            raise ValueError("only the disk tier has files")
        try:
            fd, path, named = _pool_file(self.dir)
        except OSError as e:
            raise UserError(f"cannot create a KV pool file in {self.dir}: {e.strerror or e}")
        try:
            _preallocate(fd, max(nbytes, 1), self.dir)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        finally:
            if named:  # the descriptor keeps the data; the name would only outlive a killed run
                os.unlink(path)
        self.fds.append(fd)
        self.nbytes += nbytes
        return fd

    def file_stats(self) -> list[os.stat_result]:
        """`os.fstat` of each pool file (size, blocks reserved); [] for host memory."""
        return [os.fstat(fd) for fd in self.fds]

    def files_bytes(self) -> int:
        """Bytes of the pool files on disk (apparent size); 0 for host memory."""
        return sum(st.st_size for st in self.file_stats())

    def close(self) -> None:
        self.tensors.clear()  # drop the mappings before the files go
        if self.kind == "disk":
            self._cleanup()

    def describe(self) -> str:
        if self.kind == "disk":
            return f"disk (memory-mapped unnamed files in {self.dir})"
        return "pinned host memory" if self.pinned else "host memory"


def fast_device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "CPU"
