"""Weights partly in the slow tier, streamed per layer (FlexGen's weight percentage).

A fraction of the transformer layers (spread evenly, so streamed layers sit between resident ones)
keeps its projection matrices (attention q/k/v/o, MLP) in the slow tier: pinned host memory behind a
GPU, a memory-mapped file for "disk", or plain RAM on a CPU-only host. Module forward pre-hooks drive
the stream, so it works for every runtime path (prefill, decode, teacher-forced) and for any caller of
a layer's modules (InfiniGen's speculation runs layer i+1's query projection during layer i):
  - when layer i starts (its attention norm runs), the next streamed layer's weights are fetched in the
    background (a worker thread; on CUDA a copy stream and an event);
  - the first use of a streamed layer's module waits for that fetch only and binds the fetched copies
    to the parameters (`param.data`); two layers' buffers alternate (double buffering).

    with WeightStreamer(model, fraction=0.3, kind="disk"):
        runtime.prefill(model, ...); runtime.decode(model, ...)
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import ArgumentError
from .tiers import SlowTier

_PROJ = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def streamed_layers(num_layers: int, fraction: float) -> list[int]:
    """round(fraction * L) layers, evenly spread (never two in a row when fraction <= 1/2)."""
    k = round(fraction * num_layers)
    return [i for i in range(num_layers) if (i + 1) * k // num_layers > i * k // num_layers]


class WeightStreamer:
    def __init__(self, model, fraction: float, kind: str = "cpu", directory=None, threaded: bool = True):
        if not 0 <= fraction <= 1:
            raise ArgumentError("weights_offload", f"must be in [0, 1], got {fraction}")
        self.model = model
        self.fast = model.device
        self.cuda = self.fast.type == "cuda"
        self.layers = streamed_layers(model.cfg.num_layers, fraction)
        self.tier = SlowTier("disk" if kind == "disk" else "cpu", self.fast, directory)
        self.params = {}  # layer -> [(param, slow tensor)]
        self.bound = {}  # parity -> layer whose weights are bound to the parameters from that parity's buffers
        self.occupant = {}  # parity -> layer whose weights are in (or on their way to) that parity's buffers
        self.claimed = {}  # parity -> the pass (forward call) that fetched the occupant
        self.pass_id, self.last = 0, -1  # a pass ends when the layer index goes back
        self.jobs = {}  # layer -> (future | None, event | None)
        self.buffers = {}  # (parity, i) -> fast tensor
        self.hooks = []
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="infinigen-weights") if threaded else None
        self.copy_stream = torch.cuda.Stream(self.fast) if self.cuda else None
        self.bytes_moved = 0
        self.wait_s = 0.0
        self.slow_bytes = 0

    # ---- setup ------------------------------------------------------------------------------------
    def __enter__(self):
        for i in self.layers:
            blk = self.model.layers[i]
            for owner, joined in ((blk.attn, "qkv_proj"), (blk.mlp, "gate_up_proj")):
                if getattr(owner, joined, None) is not None:  # its codes would keep the parts' fast copies alive
                    setattr(owner, joined, None)
            pairs = []
            for name in _PROJ:
                mod = _get(blk, name)
                if mod is None:
                    continue
                for p in mod.parameters(recurse=False):
                    slow = self.tier.empty(tuple(p.shape), p.dtype, name=f"w{i}")
                    slow.copy_(p.data)
                    pairs.append((p, slow))
                    p.data = slow  # the fast copy is freed (unless shared elsewhere)
                self.hooks.append(mod.register_forward_pre_hook(lambda m, a, i=i: self._ensure(i)))
            self.params[i] = pairs
            self.slow_bytes += sum(s.numel() * s.element_size() for _, s in pairs)
        for i, blk in enumerate(self.model.layers):  # layer i starts: fetch the next streamed layer
            nxt = next((j for j in self.layers if j > i), None)
            if nxt is not None:
                self.hooks.append(blk.attn_norm.register_forward_pre_hook(
                    lambda m, a, i=i, j=nxt: self._prefetch(j, i)))
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for layer in list(self.jobs):
            self._wait(layer)
        for pairs in self.params.values():  # weights back in fast memory
            for p, slow in pairs:
                p.data = slow.to(self.fast, copy=True)
        self.params.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.tier.close()

    def fast_buffer_bytes(self) -> int:
        """Fast-tier bytes of the two layers' buffers the stream alternates between."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def fraction_of_weights(self) -> float:
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return self.slow_bytes / total if total else 0.0

    # ---- streaming --------------------------------------------------------------------------------
    def _prefetch(self, layer: int, current: int | None = None) -> None:
        if current is not None:
            if current <= self.last:
                self.pass_id += 1
            self.last = current
        parity = layer % 2
        occupant = self.occupant.get(parity)
        if occupant == layer:
            self.claimed[parity] = self.pass_id
            return
        if (current is not None and occupant is not None and occupant >= current
                and self.claimed.get(parity) == self.pass_id):
            return  # the buffers hold a layer this pass still needs; this one is fetched on first use
        if occupant is not None and occupant in self.jobs:
            self._wait(occupant)
        self._release(parity)
        self.occupant[parity] = layer
        self.claimed[parity] = self.pass_id
        if self.pool is None:
            self.jobs[layer] = (None, self._copy(layer))
        else:
            self.jobs[layer] = (self.pool.submit(self._copy, layer), None)

    def _copy(self, layer: int):
        parity, ev = layer % 2, None
        dsts = []
        ctx = torch.cuda.stream(self.copy_stream) if self.cuda else _nullcontext()
        with ctx:
            for n, (p, slow) in enumerate(self.params[layer]):
                key = (parity, n)
                buf = self.buffers.get(key)
                if buf is None or buf.shape != slow.shape or buf.dtype != slow.dtype:
                    buf = self.buffers[key] = torch.empty(slow.shape, dtype=slow.dtype, device=self.fast)
                buf.copy_(slow, non_blocking=self.cuda)
                dsts.append(buf)
                self.bytes_moved += slow.numel() * slow.element_size()
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
        return ev

    def _wait(self, layer: int):
        future, ev = self.jobs.pop(layer)
        if future is not None:
            ev = future.result()
        if ev is not None:
            torch.cuda.current_stream(self.fast).wait_event(ev)

    def _release(self, parity: int) -> None:
        """Unbind the layer whose weights occupy this parity's buffers (its compute is done)."""
        old = self.bound.pop(parity, None)
        if old is not None:
            if self.cuda:  # its kernels may still read the buffers the next copy overwrites
                done = torch.cuda.Event()
                done.record()
                self.copy_stream.wait_event(done)
            for p, slow in self.params[old]:
                p.data = slow

    def _ensure(self, layer: int) -> None:
        if self.bound.get(layer % 2) == layer:
            return
        t0 = time.perf_counter()
        if layer not in self.jobs:
            self._prefetch(layer)
        self._wait(layer)
        for n, (p, _) in enumerate(self.params[layer]):
            p.data = self.buffers[(layer % 2, n)]
        self.bound[layer % 2] = layer
        self.wait_s += time.perf_counter() - t0


def _get(module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
