"""The KV placement options shared by `generate`, `ppl`, `needle` and `fewshot`: one definition of each
option, and `placement_from` that turns their values into an `infinigen.placement.Placement`.

    def cmd(..., kv_offload: str = KV_OFFLOAD, pool_bytes: Optional[str] = POOL_BYTES, capacity: Optional[float] = CAPACITY,
            pool_dir: Optional[Path] = POOL_DIR, evict: str = EVICT):
        placement = placement_from(kv_offload, pool_bytes, capacity, pool_dir, evict)
"""
from __future__ import annotations

import math
from pathlib import Path

import typer

from .. import sizes
from ..errors import UserError

KV_OFFLOAD = typer.Option("none", "--kv-offload",
                          help="Where the KV pool lives: none (fast memory), cpu (host memory behind a GPU) or disk "
                               "(a memory-mapped file); the selected rows are fetched to fast memory.")
POOL_BYTES = typer.Option(None, "--pool-bytes", help="KV pool limit in bytes, e.g. 2G or 512M (victims are overwritten when full).")
CAPACITY = typer.Option(None, "--capacity", help="KV pool limit: tokens per sequence, or a fraction in (0, 1] of the sequence.")
POOL_DIR = typer.Option(None, "--pool-dir", help="With --kv-offload disk: the folder of the pool's file (default: the "
                                                  "system temp dir; the file has no name there, so nothing is left behind).")
ROW_CACHE_BYTES = typer.Option(None, "--row-cache-bytes",
                               help="Fast memory for the rows recent steps fetched from an offloaded pool (e.g. 256M), "
                                    "so a step fetches only the rows it lacks (CPU hosts); default 0: off.")
DISK_BLOCK = typer.Option(0, "--disk-block", help="With --kv-offload disk: lay the pool out in page-aligned blocks of "
                                                   "this many tokens per layer, sequence and KV head, and read only the "
                                                   "blocks a selection names (e.g. 16, with --knob block=16); 0: off.")
CORRECT = typer.Option(True, "--correct/--no-correct",
                       help="Offloaded KV: each layer's own query corrects the selection speculated a layer ahead "
                            "(the rows it missed are fetched on demand); --no-correct reads what was speculated.")
READ_IN_PLACE = typer.Option(None, "--read-in-place/--no-read-in-place",
                             help="With --kv-offload cpu on a CUDA device: the attention reads each selection's rows "
                                  "from pinned host memory over the bus, none prefetched by a host gather (default: "
                                  "on where it applies; --no-read-in-place prefetches).")
EVICT = typer.Option("counter", "--evict", "--eviction", help="Victim choice when the pool is full: counter, lru or fifo.")


def check_read_in_place(read_in_place: bool | None, kv_offload: str, device: str) -> bool:
    """`--read-in-place` asked for needs the pool in pinned host memory behind a GPU: said before anything loads.
    Returns the placement's value (None, not asked: on, in effect only where it applies)."""
    if read_in_place and (kv_offload.strip().lower() != "cpu" or not device.startswith("cuda")):
        raise UserError(f"--read-in-place has the GPU read a pool in pinned host memory: it needs --kv-offload cpu and "
                        f"--device cuda (got --kv-offload {kv_offload} --device {device})")
    return read_in_place is not False


def parse_bytes(text: str | None, name: str = "pool-bytes") -> int | None:
    """'2G', '512M', '1.5GiB', '1000000' -> bytes (`name`: the option, for the error); `sizes.parse_bytes`."""
    return sizes.parse_bytes(text, name)


def parse_size(text: str | None, name: str) -> int | None:
    """Like `parse_bytes`, but "0" is allowed (it turns the thing off)."""
    return sizes.parse_bytes(text, name, zero=True)


def placement_from(kv_offload: str = "none", pool_bytes: str | None = None, capacity: float | None = None,
                   pool_dir: Path | None = None, evict: str = "counter", row_cache_bytes: str | None = None, **extra):
    """The Placement these options ask for (every value checked: a bad one is a UserError). `capacity`
    above 1 is a token count; at most 1, a fraction of the sequence. `row_cache_bytes`: a size ('256M'; '0' off)."""
    from ..placement import Placement
    if pool_dir is not None and kv_offload.strip().lower() != "disk":
        raise UserError(f"--pool-dir is the disk pool's folder and needs --kv-offload disk (got --kv-offload {kv_offload})")
    if capacity is not None:
        if not math.isfinite(capacity) or capacity <= 0:
            raise UserError(f"--capacity must be a positive number of tokens or a fraction in (0, 1], got {capacity}")
        if capacity > 1:
            if capacity != int(capacity):
                raise UserError(f"--capacity above 1 is a token count and must be an integer, got {capacity}")
            capacity = int(capacity)
        else:
            capacity = float(capacity)
    if kv_offload.strip().lower() == "disk":  # a folder that cannot hold the pool: said now, before loading
        from ..placement.tiers import check_pool_folder
        check_pool_folder(pool_dir)
    return Placement(kv_offload=kv_offload.strip().lower(), pool_dir=str(pool_dir) if pool_dir else None,
                     capacity=capacity, pool_bytes=parse_bytes(pool_bytes), evict=evict.strip().lower(),
                     row_cache_bytes=parse_size(row_cache_bytes, "row-cache-bytes") or 0, **extra)
