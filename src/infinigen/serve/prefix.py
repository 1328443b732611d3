"""The server's prefix cache: the keys and values of prompt prefixes that requests share (a document asked
about many times, a system prompt, a chat's history), kept in blocks of tokens so that a new request
prefills only what follows the longest cached prefix of its prompt (`runtime.prefill_in_slices(cached=n)`).

A block is keyed by a hash of every token up to its end (a chain: the same block of tokens after a different
beginning is a different key), holds every layer's keys and values of its tokens, and is evicted least
recently used once the cache's bytes pass its limit. Blocks are immutable once stored, so a request that
copied one into its own store needs no reference to it afterwards.

With a folder (`DiskTier`, `infinigen serve --prefix-cache-dir`), every block is also written there, a
safetensors file per block named by the model's fingerprint and the block's chain key (atomically: a temp
file, then a rename; by a writer thread, off the engine's loop), and a block missing in memory is looked for
there: the cache survives a restart. A file is trusted only when its metadata says this format, this model
(`prefix_fingerprint`: the weights, their dtype and mode, the device type, the torch version), this key and
this many tokens, and its tensors have exactly the shapes and dtype this model's blocks have; anything else
(a truncated or foreign file) is skipped, counted, logged once and removed. The folder is bounded: beyond its
limit, the files least recently used (by mtime: a hit touches its file) are deleted.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("infinigen.serve")

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
IN_FLIGHT_BYTES = 32 << 20


def prefix_fingerprint(model) -> str:
    """What the keys and values a prefill computes depend on, as a short hex string: the skew artifact's
    fingerprint (`skew.model_fingerprint`: the config and a few attention weights), the compute dtype, the
    weight mode, the device type and the torch version, and the names, shapes, dtypes and first and last
    elements of every parameter and buffer (so that weights changed anywhere tell models apart without
    hashing all of them)."""
    from .. import __version__
    from ..skew import model_fingerprint
    info = getattr(model, "weights_info", None)
    h = hashlib.sha256(json.dumps([FORMAT_VERSION, model_fingerprint(model), str(model.dtype),
                                   str(model.device.type), torch.__version__, __version__,
                                   getattr(info, "mode", None), getattr(info, "group", None)]).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            sample = torch.cat([flat[:64], flat[-64:]]).cpu()
            h.update((sample.float() if sample.dtype not in (torch.float32, torch.float64) else sample)
                     .contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


@dataclass
class _Block:
    keys: list[torch.Tensor]  # per layer [1, Hkv, block, d]
    values: list[torch.Tensor]
    nbytes: int


class DiskTier:
    """A folder of blocks, one safetensors file each, under a byte limit (`PrefixCache` reads and feeds it).

    `shape` is (layers, KV heads, head_dim, dtype) of this model's blocks: a file must hold exactly those."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int, fingerprint: str, block_tokens: int,
                 shape: tuple[int, int, int, torch.dtype], device: torch.device | str = "cpu"):
        if max_bytes < 0:
            raise ValueError("the prefix cache folder's max_bytes must be >= 0")
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.fingerprint, self.block_tokens = max_bytes, fingerprint, block_tokens
        self.layers, self.kv_heads, self.head_dim, self.dtype = shape
        self.device = torch.device(device)
        self.hits = self.hit_tokens = self.skipped = self.evictions = self.writes = self.write_errors = 0
        self._logged: set[str] = set()
        self._clock = 0  # the last mtime set (`_touch`)
        self._lock = threading.Lock()  # the byte count and the folder's listing: the writer and lookups
        self._clean_partials()
        self.bytes = sum(size for _, _, size, _ in self._listing())
        # blocks handed to the writer and not written yet are copies in memory: at most IN_FLIGHT_BYTES of them
        # (a prompt of 8000 tokens is ~180 MB of blocks), so that a long prompt's insert cannot push a server past
        # its memory bound while the next prompt's prefill runs
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = 2 * self.layers * self.kv_heads * self.head_dim * block_tokens * itemsize
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, IN_FLIGHT_BYTES // max(1, block_bytes)))
        self._writer = threading.Thread(target=self._write_loop, name="infinigen-prefix-writer", daemon=True)
        self._writer.start()

    def _files(self) -> list[Path]:
        return [f for f in self.dir.iterdir() if f.name.endswith(SUFFIX) and not f.name.startswith(".")]

    def _listing(self) -> list[tuple[int, str, int, Path]]:
        """(mtime ns, name, size, path) of every block file (one deleted meanwhile is left out)."""
        out = []
        for f in self._files():
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((st.st_mtime_ns, f.name, st.st_size, f))
        return out

    def _clean_partials(self, older_than_s: float = 600) -> None:
        """Temp files a killed server left (a live one sharing the folder writes each within seconds)."""
        cutoff = time.time() - older_than_s
        for f in self.dir.glob(".*.partial"):
            try:
                if f.stat().st_mtime < cutoff:
                    f.unlink()
            except OSError:
                pass

    def path(self, key: bytes) -> Path:
        return self.dir / f"{self.fingerprint}-{self.block_tokens}-{key.hex()}{SUFFIX}"

    # ---- reading --------------------------------------------------------------------------------------
    def load(self, key: bytes) -> "_Block | None":
        """The block stored under `key`, checked; None when there is none or it is not to be trusted."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            block = self._read(path, key)
        except FileNotFoundError:  # evicted meanwhile (by this server's writer, or another's): a miss
            return None
        except Exception as e:  # truncated, corrupt, another model's, another layout: never trusted
            if not path.exists():
                return None
            self._skip(path, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        self._touch(path)
        return block

    def _touch(self, path: Path) -> None:
        """Mark a file used now: the folder evicts by mtime. Set explicitly, strictly increasing within this
        process: the file system's clock can give files written a few ms apart the same mtime."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            now = self._clock
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass

    def _read(self, path: Path, key: bytes) -> "_Block":
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            want = {"format": str(FORMAT_VERSION), "fingerprint": self.fingerprint, "key": key.hex(),
                    "tokens": str(self.block_tokens)}
            for name, value in want.items():
                if meta.get(name) != value:
                    raise ValueError(f"metadata {name} is {meta.get(name)!r}, not {value!r}")
            names = [f"{kind}{i}" for kind in "kv" for i in range(self.layers)]
            if sorted(f.keys()) != sorted(names):
                raise ValueError(f"tensors {sorted(f.keys())[:4]}..., not k0..k{self.layers - 1}, v0..")
            tensors = {n: f.get_tensor(n).to(self.device) for n in names}
        shape = (1, self.kv_heads, self.block_tokens, self.head_dim)
        for n, t in tensors.items():
            if tuple(t.shape) != shape or t.dtype != self.dtype:
                raise ValueError(f"{n} is {tuple(t.shape)} {t.dtype}, not {shape} {self.dtype}")
        keys = [tensors[f"k{i}"] for i in range(self.layers)]
        values = [tensors[f"v{i}"] for i in range(self.layers)]
        return _Block(keys, values, sum(t.numel() * t.element_size() for t in keys + values))

    def _skip(self, path: Path, why: str) -> None:
        self.skipped += 1
        if path.name not in self._logged:
            self._logged.add(path.name)
            log.warning("prefix cache: skipped %s (%s)", path, why)
        try:
            size = path.stat().st_size
            path.unlink()  # its block is computed again and written anew
            with self._lock:
                self.bytes = max(0, self.bytes - size)
        except OSError:
            pass

    # ---- writing --------------------------------------------------------------------------------------
    def save(self, key: bytes, block: "_Block", keep: frozenset[bytes] = frozenset()) -> None:
        """Write the block (by the writer thread; waits while IN_FLIGHT_BYTES of blocks are not written yet);
        `keep`: keys that eviction spares (its prompt's chain)."""
        self._queue.put((key, block, keep))

    def holds(self, key: bytes) -> bool:
        """Whether the folder has a file for `key` (not read, not checked: `load` checks what it reads)."""
        return self.path(key).is_file()

    def touch(self, key: bytes, keep: frozenset[bytes] = frozenset()) -> None:
        """Mark the block's file used now, by the writer thread (in order with the writes and evictions)."""
        self._queue.put((key, None, keep))

    def flush(self) -> None:
        """Wait until every block handed to `save` is written."""
        self._queue.join()

    def _write_loop(self) -> None:
        while True:
            key, block, keep = self._queue.get()
            try:
                self._write(key, block, keep)
            except Exception as e:  # a full or read-only disk: the server goes on, the block stays in memory
                self.write_errors += 1
                if self.write_errors == 1:
                    log.warning("prefix cache: cannot write to %s (%s)", self.dir, e)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block: "_Block", keep: frozenset[bytes]) -> None:
        from safetensors.torch import save_file
        path = self.path(key)
        if path.is_file():
            self._touch(path)
            return
        if block is None or block.nbytes > self.max_bytes:  # a touch of a file evicted meanwhile: gone
            return
        tensors = {f"{kind}{i}": t.contiguous().cpu() for kind, ts in (("k", block.keys), ("v", block.values))
                   for i, t in enumerate(ts)}
        meta = {"format": str(FORMAT_VERSION), "fingerprint": self.fingerprint, "key": key.hex(),
                "tokens": str(self.block_tokens)}
        tmp = self.dir / f".{path.name}.{os.getpid()}.{threading.get_ident()}.partial"
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)  # atomic: a reader (this server after a restart, another one) sees all or none
        finally:
            tmp.unlink(missing_ok=True)
        self._touch(path)
        self.writes += 1
        with self._lock:
            self.bytes += path.stat().st_size
            if self.bytes > self.max_bytes:
                self._evict({self.path(k).name for k in keep} | {path.name})

    def _evict(self, spared: set[str]) -> None:
        """Delete the least recently used files until the folder is under its limit (listed anew: another
        server may share the folder)."""
        files = self._listing()
        self.bytes = sum(size for _, _, size, _ in files)
        for _, name, size, f in sorted(files):
            if self.bytes <= self.max_bytes:
                break
            if name in spared:
                continue
            try:
                f.unlink()
            except OSError:
                continue
            self.bytes -= size
            self.evictions += 1


class PrefixCache:
    def __init__(self, max_bytes: int, block_tokens: int = 256, disk: DiskTier | None = None):
        if max_bytes < 0 or block_tokens < 1:
            raise ValueError("max_bytes must be >= 0 and block_tokens >= 1")
        if disk is not None and disk.block_tokens != block_tokens:
            raise ValueError("the disk tier's blocks must be of block_tokens")
        self.max_bytes, self.block_tokens, self.disk = max_bytes, block_tokens, disk
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # LRU first
        self.bytes = 0
        self.hits = self.hit_tokens = self.evictions = self.lookups = 0

    def _keys(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The chained hash of each of the first `blocks` whole blocks of `tokens`."""
        out, h = [], hashlib.blake2b(digest_size=16)
        b = self.block_tokens
        for i in range(blocks):
            h.update(torch.tensor(tokens[i * b:(i + 1) * b], dtype=torch.int64).numpy().tobytes())
            out.append(h.copy().digest())
        return out

    def lookup(self, tokens: list[int]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """(n, keys, values): `lookup_blocks`' prefix as per-layer [1, Hkv, n, d] tensors (a copy of the whole
        prefix)."""
        n, found = self.lookup_blocks(tokens)
        if not found:
            return 0, [], []
        layers = len(found[0].keys)
        keys = [torch.cat([blk.keys[i] for blk in found], dim=2) for i in range(layers)]
        values = [torch.cat([blk.values[i] for blk in found], dim=2) for i in range(layers)]
        return n, keys, values

    def lookup_blocks(self, tokens: list[int]) -> tuple[int, list["_Block"]]:
        """(n, blocks): the longest cached prefix of `tokens` in whole blocks that leaves at least one token to
        prefill (its logits give the first new token), as the cache's blocks in order (each holds per-layer
        keys and values [1, Hkv, block_tokens, d]; immutable, so a store copies them one at a time)."""
        self.lookups += 1
        found: list[_Block] = []
        chain = self._keys(tokens, (len(tokens) - 1) // self.block_tokens)
        from_disk = 0
        for key in chain:
            block = self._blocks.get(key)
            if block is None and self.disk is not None:  # the persistent tier: kept in memory once read
                block = self.disk.load(key)
                if block is not None:
                    from_disk += 1
                    self._keep(key, block, set(chain))
            if block is None:
                break
            if key in self._blocks:
                self._blocks.move_to_end(key)
            found.append(block)
        if not found:
            return 0, []
        n = len(found) * self.block_tokens
        self.hits += 1
        self.hit_tokens += n
        if from_disk:
            self.disk.hits += 1
            self.disk.hit_tokens += from_disk * self.block_tokens
        return n, found

    def insert(self, tokens: list[int], store) -> None:
        """Keep the whole blocks of a prompt whose prefill just ended in `store` (slots 0.. hold its tokens in
        order) that the cache does not hold yet, then evict down to the byte limit. Each block is read from the
        store on its own (`keys_values`: views of a store in memory, a read of a pool file on disk); a block the
        folder holds already is only touched there (a hit's blocks beyond what memory keeps)."""
        b = self.block_tokens
        chain = self._keys(tokens, len(tokens) // b)
        mine = set(chain)
        for i, key in enumerate(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                if self.disk is not None:
                    self.disk.save(key, self._blocks[key], frozenset(mine))  # on disk already: touched
                continue
            if self.disk is not None and self.disk.holds(key):  # a hit read from the folder: not read again
                self.disk.touch(key, frozenset(mine))  # from the store (a whole prompt of a pool file on disk)
                continue
            keys, values = [], []
            for layer in range(len(store.k)):
                k, v = store.keys_values(layer, i * b, (i + 1) * b)
                keys.append(k.clone())
                values.append(v.clone())
            block = _Block(keys, values, sum(t.numel() * t.element_size() for t in keys + values))
            if self.disk is not None:
                self.disk.save(key, block, frozenset(mine))
            if not self._keep(key, block, mine) and self.disk is None:
                return  # the rest of this prompt does not fit: its cached beginning stays useful

    def _keep(self, key: bytes, block: _Block, mine: set[bytes]) -> bool:
        """Put a block in memory, evicting the least recently used blocks of other prompts (evicting this
        prompt's own earlier blocks would cut the chain that makes its later blocks reachable); False when
        it does not fit."""
        while self.bytes + block.nbytes > self.max_bytes:
            victim = next((k for k in self._blocks if k not in mine), None)
            if victim is None:
                return False
            self.bytes -= self._blocks.pop(victim).nbytes
            self.evictions += 1
        self._blocks[key] = block
        self.bytes += block.nbytes
        return True

    def __len__(self) -> int:
        return len(self._blocks)
