"""`ServerConfig`: everything `infinigen serve` is told, as one typed, frozen record.

Each field is typed and documented where it is declared, and its bounds (`lo`, `hi`, `choices` in the field's
metadata) are checked at construction, so a config that exists is one the server can start with. The command
line fills it from its flags (byte sizes already parsed), `commands.serve.build` makes the app from it, and a
Ray Serve replica receives it whole. A bad value is a `UserError` naming the flag.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..errors import UserError

OFFLOADS = ("none", "cpu", "disk")
MAX_INT64 = 2 ** 63 - 1


def _option(default, doc: str, flag: str, lo=None, hi=None, choices: tuple = ()):
    """A field with its one line of doc, the command-line flag that sets it and its bounds."""
    return field(default=default, metadata=dict(doc=doc, flag=flag, lo=lo, hi=hi, choices=choices))


@dataclass(frozen=True)
class ServerConfig:
    """What one server (or each of its Ray Serve replicas) loads and how it admits requests."""

    model: str = _option("default", "a GGUF file, a Hugging Face checkpoint folder, or 'default'", "--model")
    policy: str = _option("full", "the KV-cache policy's registry name", "--policy")
    knobs: tuple[str, ...] = _option((), "the policy's knobs, each NAME=VALUE", "--knob")
    kv_offload: str = _option("none", "where the KV pool lives: fast memory, host memory behind a GPU, or "
                              "memory-mapped files", "--kv-offload", choices=OFFLOADS)
    pool_dir: Optional[str] = _option(None, "folder of the disk pool's files (None: a temp dir)", "--pool-dir")
    disk_block: int = _option(0, "the disk pool in page-aligned blocks of this many tokens per layer and KV "
                              "head, read with positioned reads of the blocks a selection names (0: a "
                              "memory-mapped file)", "--disk-block", lo=0)
    memory_limit: Optional[int] = _option(None, "the memory bound the server runs under in bytes, its page cache "
                                          "included (None: the cgroup's limit, if any)", "--memory-limit",
                                          lo=1 << 20, hi=MAX_INT64)
    pool_bytes: Optional[int] = _option(None, "KV pool budget in bytes in the tier that holds it (None: the "
                                        "tier's default)", "--pool-bytes", lo=1, hi=MAX_INT64)
    fast_bytes: Optional[int] = _option(None, "fast-memory budget in bytes for the KV and what requests hold "
                                        "there (None: a quarter of the device's memory)", "--fast-bytes",
                                        lo=1, hi=MAX_INT64)
    max_batch: int = _option(16, "requests decoded together at most", "--max-batch", lo=1)
    max_queue: int = _option(64, "requests waiting for KV memory at most; beyond them a 429", "--max-queue", lo=0)
    prefix_cache: bool = _option(True, "reuse the KV of prompt prefixes that requests share", "--prefix-cache")
    prefix_cache_bytes: Optional[int] = _option(None, "the prefix cache's limit in bytes (None: an eighth of "
                                                "the fast budget)", "--prefix-cache-bytes", lo=1, hi=MAX_INT64)
    prefix_cache_dir: Optional[str] = _option(None, "folder where the prefix cache's blocks persist (None: "
                                              "memory only)", "--prefix-cache-dir")
    prefix_cache_dir_bytes: Optional[int] = _option(None, "the folder's limit in bytes (None: 4x the prefix "
                                                    "cache's)", "--prefix-cache-dir-bytes", lo=1, hi=MAX_INT64)
    prefill_chunk_layers: int = _option(1, "layers of a joining prompt prefilled per decode step (0: the "
                                        "whole prompt at once)", "--prefill-chunk-layers", lo=0)
    host: str = _option("127.0.0.1", "address to listen on", "--host")
    port: int = _option(8000, "port to listen on (0: one the system chooses)", "--port", lo=0, hi=65535)
    served_model_name: Optional[str] = _option(None, "the model name clients ask for (None: the model's "
                                               "name)", "--served-model-name")
    replicas: int = _option(1, "engine replicas; more than 1 runs them on Ray Serve", "--replicas", lo=1)
    device: Optional[str] = _option(None, "the device the model runs on (None: the CPU)", "--device")
    dtype: str = _option("auto", "the weights' and KV's dtype ('auto': what loading picks for the device)",
                         "--dtype")
    compile: str = _option("auto", "compile the decoding step: auto, on, whole or off (off while batch_invariant)",
                           "--compile", choices=("auto", "on", "whole", "off"))
    decode_threads: Optional[int] = _option(None, "torch threads a decoding step runs on (None: on a CPU all of "
                                            "torch's threads but one, at least one; prompts are prefilled on all)",
                                            "--decode-threads", lo=1, hi=4096)
    batch_invariant: bool = _option(True, "a request's greedy tokens do not depend on the requests decoded "
                                    "beside it (each attention its own call, the step eager)",
                                    "--batch-invariant")

    def __post_init__(self):
        object.__setattr__(self, "knobs", tuple(self.knobs))  # frozen: a list given is kept as a tuple
        for f in dataclasses.fields(self):
            _check_bounds(f, getattr(self, f.name))
        if self.batch_invariant and self.compile in ("on", "whole"):
            raise UserError("--compile on: the compiled step's kernels depend on the batch size, so it is not "
                            "batch-invariant; add --no-batch-invariant to compile it")
        if self.disk_block and self.kv_offload != "disk":
            raise UserError(f"--disk-block lays out the disk pool and needs --kv-offload disk (got --kv-offload "
                            f"{self.kv_offload})")
        if self.memory_limit is not None and self.replicas > 1:
            raise UserError("--memory-limit bounds one server process; with --replicas give each replica's "
                            "--fast-bytes instead")
        if self.prefix_cache_dir_bytes is not None and self.prefix_cache_dir is None:
            raise UserError("--prefix-cache-dir-bytes is the limit of the prefix cache's folder and needs "
                            "--prefix-cache-dir")
        if not self.prefix_cache and any(v is not None for v in (self.prefix_cache_bytes, self.prefix_cache_dir,
                                                                 self.prefix_cache_dir_bytes)):
            raise UserError("--prefix-cache-bytes, --prefix-cache-dir and --prefix-cache-dir-bytes set the prefix "
                            "cache that --no-prefix-cache turns off")

    @property
    def compile_mode(self) -> str:
        """What the step does: "off" while batch-invariant (its kernels would depend on the batch size)."""
        return "off" if self.batch_invariant else self.compile

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Each field's flag and one line of doc (with its bounds), in declaration order."""
        out = {}
        for f in dataclasses.fields(cls):
            m = f.metadata
            bounds = [f"one of {', '.join(m['choices'])}"] if m["choices"] else []
            bounds += [f">= {m['lo']}"] if m["lo"] is not None else []
            bounds += [f"<= {m['hi']}"] if m["hi"] is not None and m["hi"] != MAX_INT64 else []
            out[f.name] = f"{m['flag']}: {m['doc']}" + (f" ({', '.join(bounds)})" if bounds else "")
        return out


def _check_bounds(f: dataclasses.Field, value) -> None:
    """UserError naming the field's flag unless `value` lies within the bounds its metadata declares."""
    m, flag = f.metadata, f.metadata["flag"]
    if value is None:
        return
    if m["choices"] and value not in m["choices"]:
        raise UserError(f"{flag} must be one of {', '.join(m['choices'])}, got {value!r}")
    if m["lo"] is None and m["hi"] is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{flag} must be a whole number (got {value!r})")
    if m["lo"] is not None and value < m["lo"]:
        raise UserError(f"{flag} must be >= {m['lo']} (got {value})")
    if m["hi"] is not None and value > m["hi"]:
        raise UserError(f"{flag} must be <= {m['hi']} (got {value})")
