"""The memory bound a server runs under (`--memory-limit`, or the limit of the cgroup it was started in).

Two uses. Before the model loads, `check_before_loading` refuses a bound that cannot hold the server as it
stands, the model's weights and one request's fast state (a floor: the server would be killed while loading
or could never admit a request). Once the model is loaded, `fast_budget_under` turns what the bound leaves
beside the loaded server into the fast-memory budget that admission charges requests against (the KV that
stays in RAM, policy state and fetched rows); with the pool on disk, the pool's bytes count against the
slow budget only, so conversations whose KV together exceeds the bound are admitted.
"""
from __future__ import annotations

from pathlib import Path

from .. import membound
from ..errors import UserError

MIB = 1 << 20


def server_bound(memory_limit: int | None) -> tuple[int, str] | None:
    """(bytes, what sets it): `memory_limit` when given, else the memory cgroup's limit; None when unbounded."""
    if memory_limit is not None:
        return memory_limit, "--memory-limit"
    limit = membound.cgroup_limit()
    return (limit, "the memory cgroup's limit") if limit is not None else None


def parameter_count(cfg) -> int:
    """The weights' elements as the model's shape implies (embedding, attention, MLP, untied head)."""
    h, layers = cfg.hidden_size, cfg.num_layers
    attention = 2 * h * cfg.num_heads * cfg.head_dim + 2 * h * cfg.num_kv_heads * cfg.head_dim
    mlp = (2 if cfg.arch == "opt" else 3) * h * cfg.intermediate_size
    embedding = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return embedding + layers * (attention + mlp)


def weights_bytes(cfg, gguf: Path | None, element_bytes: int, mode: str) -> int:
    """The weights' bytes in memory once loaded: a GGUF's blocks as the file stores them (weight mode "file"),
    otherwise every element in the compute dtype."""
    if gguf is not None and mode == "file":
        return gguf.stat().st_size
    return parameter_count(cfg) * element_bytes


def request_fast_floor(cfg, element_bytes: int, disk_block: int) -> int:
    """The least fast memory one request of two tokens holds: their keys and values (in RAM, or fetched from
    the pool), and with the block layout the block each (layer, KV head) is filling, held in RAM whole."""
    row = cfg.head_dim * element_bytes
    floor = 2 * 2 * cfg.num_layers * cfg.num_kv_heads * row
    if disk_block:
        from ..placement.blocks import unit_bytes
        floor += cfg.num_layers * cfg.num_kv_heads * unit_bytes(disk_block, row)
    return floor


def check_before_loading(bound: tuple[int, str], resident: int, weights: int, request: int) -> None:
    """UserError (one line, how much is needed) when the bound is below the server as it stands (`resident`),
    the weights and one request's fast state."""
    limit, source = bound
    need = resident + weights + request
    if limit < need:
        raise UserError(f"{source} of {limit / MIB:.0f} MiB cannot hold the server: it needs at least "
                        f"{need / MIB:.0f} MiB (the process as it stands {resident / MIB:.0f} MiB, the model's "
                        f"weights {weights / MIB:.0f} MiB, one request's fast state {request / MIB:.1f} MiB)")


def fast_budget_under(bound: tuple[int, str], resident: int) -> int:
    """The fast-memory budget for requests: half of what the bound leaves beside the loaded server (the other
    half for a prompt's transient activations and the page cache the pool's reads go through)."""
    limit, source = bound
    left = limit - resident
    if left <= 0:
        raise UserError(f"{source} of {limit / MIB:.0f} MiB leaves nothing for requests: the loaded server holds "
                        f"{resident / MIB:.0f} MiB")
    return left // 2
