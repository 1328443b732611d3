"""Memory accounting of one benchmark run: peak memory (CUDA allocator, or the process's peak RSS on a
CPU host), weight and KV bytes."""
from __future__ import annotations

import gc

import torch

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
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


# ---- runs ------------------------------------------------------------------------------------------
def _collect(model, batch: int, length: int) -> None:
    """A full garbage collection (half a second with transformers imported) only where a run's memory
    is large enough to matter to the next run's peak."""
    if batch * length > 1 << 13:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _kv_bytes(model, batch: int, length: int) -> int:
    cfg = model.cfg
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * length * cfg.head_dim * model.dtype.itemsize
