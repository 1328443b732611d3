"""Memory accounting, in one place: bytes of weights, of a KV cache, of what a live session holds, and of
the device. A ground-floor module (torch only): policies, the server and the benchmark all import it.

Every KV store reports its own fast-tier and slow-tier bytes (`KVStore.fast_bytes`, `slow_bytes`); what a
policy keeps per request is found by walking its state for tensors (`storages`).
"""
from __future__ import annotations

import dataclasses
import os

import torch


def tensor_bytes(x) -> int:
    """Bytes of the tensors in x (nested in dicts, lists and tuples)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size() if x.device.type != "meta" else 0
    if isinstance(x, dict):
        return sum(tensor_bytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(tensor_bytes(v) for v in x)
    return 0


def weight_bytes(model) -> int:
    """Bytes of a model's parameters, each storage once (tied embeddings, and parameters that are views of
    another's storage, such as joined projections' parts, count once)."""
    storages = {}
    for p in model.parameters():
        storages[(p.device, p.untyped_storage().data_ptr())] = p.untyped_storage().nbytes()
    return sum(storages.values())


def kv_bytes(cfg, batch: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a dense KV cache: keys and values of `length` tokens for `batch` sequences, every layer."""
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * length * cfg.head_dim * dtype.itemsize


def storages(obj, out: dict, depth: int = 0) -> dict:
    """The tensor storages reachable from obj, data_ptr -> bytes, into `out` (returned): through dicts,
    lists, tuples, sets, dataclasses and plain objects, down to a few levels; a `torch.nn.Module` is not
    entered (a model's weights are shared by every request)."""
    if depth > 4 or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
        return out
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.device.type != "meta" and st.nbytes():
            out[st.data_ptr()] = st.nbytes()
        return out
    if isinstance(obj, torch.nn.Module):
        return out
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return out
    for x in items:
        storages(x, out, depth + 1)
    return out


def session_bytes(session, shared: dict | None = None) -> tuple[int, int]:
    """(fast-tier, slow-tier) bytes a live session holds: what its KV store reports (an offloaded store:
    metadata and fetched rows in the fast tier, the pool in the slow one), plus the tensors of its policy's
    per-request state and of the store's victim policy (storages in `shared`, e.g. skew matrices every
    request reads, are not counted)."""
    store = session.store
    fast, slow = store.fast_bytes(), store.slow_bytes()
    state = storages(session.state, {})
    if store.allocator is not None:
        storages(store.allocator, state)
    fast += sum(b for p, b in state.items() if not shared or p not in shared)
    return fast, slow


def resident_bytes() -> int | None:
    """This process's resident set now (Linux VmRSS); None where /proc does not say."""
    return _status_bytes("self", "VmRSS")


def device_memory_bytes(device) -> int | None:
    """Memory of the device the KV cache lives on (total, not free: a bound, not a forecast); None when unknown."""
    try:
        if str(device).startswith("cuda"):
            return torch.cuda.mem_get_info(torch.device(device))[1]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        return None


class MemoryProbe:
    """Peak memory of one run: CUDA allocator peak on a GPU; on a CPU host the process's peak resident
    set (Linux VmHWM, reset per run through /proc/self/clear_refs) next to the tracked fast-tier bytes."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak RSS counter
        except OSError:
            pass

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss_of("self")


def _glibc_function(name: str):
    """glibc's function `name` through ctypes, or None where the C library is not glibc."""
    import ctypes
    import ctypes.util
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = None


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the operating system (glibc's malloc_trim; False elsewhere).
    A long-running process that frees tensors of many sizes keeps their pages otherwise: the server's RSS
    grew by about 1 MiB/s under a mixed load with no leaked object (benchmarks/serve_soak.py)."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _glibc_function("malloc_trim") or False
    if _malloc_trim is False:
        return False
    _malloc_trim(0)
    return True


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """Allocations of `threshold` bytes or more get pages of their own from the OS, returned when freed (glibc's
    mallopt; False elsewhere). By default glibc raises that threshold up to 32 MiB as large blocks are freed,
    so a long prompt's per-layer tensors are carved from the heap and their pages stay with the process
    between trims: an 8000-token InfiniGen prefill rose ~0.4 GiB above its start where it rises ~0.2 with this.
    For a process under a memory bound, where a peak is what the kernel kills for."""
    mallopt = _glibc_function("mallopt")
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))


__all__ = ["tensor_bytes", "weight_bytes", "kv_bytes", "storages", "session_bytes", "device_memory_bytes",
           "MemoryProbe", "release_free_heap", "map_large_allocations"]


def peak_rss_of(pid: int | str) -> int | None:
    """A process's peak resident set (VmHWM) in bytes, from /proc; None where it cannot be read."""
    return _status_bytes(pid, "VmHWM")


def _status_bytes(pid: int | str, field: str) -> int | None:
    """A size field of /proc/PID/status ("VmRSS", "VmHWM") in bytes; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
