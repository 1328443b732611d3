"""The server's prefix cache: the keys and values of prompt prefixes that requests share (a document asked
about many times, a system prompt, a chat's history), kept in blocks of tokens so that a new request
prefills only what follows the longest cached prefix of its prompt (`runtime.prefill_in_slices(cached=n)`).

A block is keyed by a hash of every token up to its end (a chain: the same block of tokens after a different
beginning is a different key), holds every layer's keys and values of its tokens, and is evicted least
recently used once the cache's bytes pass its limit. Blocks are immutable once stored, so a request that
copied one into its own store needs no reference to it afterwards.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass

import torch


@dataclass
class _Block:
    keys: list[torch.Tensor]  # per layer [1, Hkv, block, d]
    values: list[torch.Tensor]
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int, block_tokens: int = 256):
        if max_bytes < 0 or block_tokens < 1:
            raise ValueError("max_bytes must be >= 0 and block_tokens >= 1")
        self.max_bytes, self.block_tokens = max_bytes, block_tokens
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
        """(n, keys, values): the longest cached prefix of `tokens` in whole blocks that leaves at least one
        token to prefill (its logits give the first new token), as per-layer [1, Hkv, n, d] tensors."""
        self.lookups += 1
        found: list[_Block] = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.block_tokens):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        if not found:
            return 0, [], []
        n = len(found) * self.block_tokens
        self.hits += 1
        self.hit_tokens += n
        layers = len(found[0].keys)
        keys = [torch.cat([blk.keys[i] for blk in found], dim=2) for i in range(layers)]
        values = [torch.cat([blk.values[i] for blk in found], dim=2) for i in range(layers)]
        return n, keys, values

    def insert(self, tokens: list[int], store) -> None:
        """Keep the whole blocks of a prompt whose prefill just ended in `store` (slots 0.. hold its tokens in
        order) that the cache does not hold yet, then evict down to the byte limit."""
        b = self.block_tokens
        chain = self._keys(tokens, len(tokens) // b)
        mine = set(chain)
        for i, key in enumerate(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            keys, values = [], []
            for layer in range(len(store.k)):
                k, v, _, _ = store.past(layer)
                keys.append(k[:, :, i * b:(i + 1) * b].clone())
                values.append(v[:, :, i * b:(i + 1) * b].clone())
            nbytes = sum(t.numel() * t.element_size() for t in keys + values)
            # room from the least recently used blocks of other prompts: evicting this prompt's own earlier
            # blocks would cut the chain that makes its later blocks reachable
            while self.bytes + nbytes > self.max_bytes:
                victim = next((k for k in self._blocks if k not in mine), None)
                if victim is None:
                    return  # the rest of this prompt does not fit: its cached beginning stays useful
                self.bytes -= self._blocks.pop(victim).nbytes
                self.evictions += 1
            self._blocks[key] = _Block(keys, values, nbytes)
            self.bytes += nbytes

    def __len__(self) -> int:
        return len(self._blocks)
