"""Optional per-layer time breakdown of decoding (the paper's Figure 18): speculation/selection, issuing
the prefetch (row indices, job hand-off), fetch wait (transfer), attention, MLP and the rest, per layer,
averaged over steps.

Instrumentation wraps instance methods of the session, the MLPs, the policy and the store with clocks
(nested calls count once: a parent's time excludes its children's). On CUDA each clock reading
synchronizes the device, which removes the overlap it measures: take throughput from uninstrumented
runs and use this only to see where time goes. The worker thread's gather time is reported apart
("gather (worker)"): it overlaps compute and is not part of the main thread's total.

Where the store corrects a speculated selection, `detail` times what the correction adds on the main thread
(inclusive, apart from the categories): the layer's own selection (the policy's `keep` asked with the layer's own
query), handing the rows over (`hand_rows`), the corrected hand-over (`_corrected`) and the on-demand reads in it.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict

import torch

from .. import runtime

CATEGORIES = ("speculation", "prefetch issue", "fetch wait", "attention", "mlp", "other")


class Breakdown:
    def __init__(self, model, session):
        self.model, self.session = model, session
        self.device = model.device
        self.totals = defaultdict(float)  # (layer, category) -> seconds (exclusive)
        self.stack: list[list] = []  # [category, layer, start, child_time]
        self.steps = 0
        self.step_time = 0.0
        self._undo = []
        self.detail = defaultdict(float)  # name -> seconds on the main thread, inclusive (see the module doc)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _wrap(self, obj, name: str, category: str, layer_of=lambda args: args[0] if args else -1):
        orig = getattr(obj, name)
        had = name in vars(obj)

        def timed(*args, **kwargs):
            self.stack.append([category, layer_of(args), self._now(), 0.0])
            try:
                return orig(*args, **kwargs)
            finally:
                cat, layer, start, child = self.stack.pop()
                spent = self._now() - start
                self.totals[(layer, cat)] += spent - child
                if self.stack:
                    self.stack[-1][3] += spent

        object.__setattr__(obj, name, timed)  # policies are frozen dataclasses: an instance attribute all the same
        self._undo.append((obj, name, orig if had else None))

    def _clock(self, obj, name: str, key: str, counts=lambda args: True) -> None:
        """Add the main thread's time in obj.name to `detail[key]` where `counts(args)` (inclusive)."""
        if not hasattr(obj, name):
            return
        orig = getattr(obj, name)
        had = name in vars(obj)

        def clocked(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread() or not counts(args):
                return orig(*args, **kwargs)
            t0 = self._now()
            try:
                return orig(*args, **kwargs)
            finally:
                self.detail[key] += self._now() - t0

        object.__setattr__(obj, name, clocked)
        self._undo.append((obj, name, orig if had else None))

    def __enter__(self):
        pol, store, model = self.session.policy, self.session.store, self.model
        if getattr(store, "corrects", False):  # inside the category clocks: those see one call each
            self._clock(pol, "keep", "own selection", lambda args: getattr(args[1], "query", None) is not None)
            self._clock(store, "hand_rows", "hand rows")
            self._clock(store, "_corrected", "corrected hand-over")
            self._clock(store, "_load", "on-demand reads")
        for hook in ("on_hidden", "keep", "observe", "on_append"):
            self._wrap(pol, hook, "speculation")
        # getting the rows: waiting for a prefetch, gathering in place, or packing a selection's rows
        for read in ("dense", "select_rows", "gather_rows"):
            self._wrap(store, read, "fetch wait")
        self._wrap(store, "ahead", "prefetch issue", layer_of=lambda args: args[0] + 1)
        self._wrap(self.session, "attend", "attention")
        for i, blk in enumerate(model.layers):
            self._wrap(blk.mlp, "forward", "mlp", layer_of=lambda args, i=i: i)
        self._stats0 = _store_gather(store)
        return self

    def __exit__(self, *exc):
        for obj, name, orig in reversed(self._undo):
            if orig is None:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, orig)
        self._undo.clear()
        self.worker_gather_s = _store_gather(self.session.store) - self._stats0

    def step(self, tokens):
        """One timed decoding step."""
        t0 = self._now()
        out = runtime.decode(self.model, tokens, self.session)
        self.step_time += self._now() - t0
        self.steps += 1
        return out

    def per_layer(self) -> list[dict]:
        """Milliseconds per step for each layer and category; "other" is the layer's share of the rest."""
        n = self.model.cfg.num_layers
        steps = max(self.steps, 1)
        rows = []
        for layer in range(n):
            row = {c: 1e3 * self.totals.get((layer, c), 0.0) / steps for c in CATEGORIES[:-1]}
            rows.append(row)
        outside = sum(v for (layer, _), v in self.totals.items() if layer < 0)  # before the first layer
        accounted = sum(sum(r.values()) for r in rows) + 1e3 * outside / steps
        rest = max(1e3 * self.step_time / steps - accounted, 0.0)
        for r in rows:
            r["other"] = rest / n
        return rows

    def summary(self) -> dict:
        """Per-block average (ms) by category, the step time, and the worker's overlapped gather time."""
        rows = self.per_layer()
        n = len(rows)
        steps = max(self.steps, 1)
        block = {c: sum(r[c] for r in rows) / n for c in CATEGORIES}
        out = {"per_block_ms": block, "step_ms": 1e3 * self.step_time / steps,
               "worker_gather_ms_per_step": 1e3 * self.worker_gather_s / steps, "per_layer_ms": rows}
        if self.detail:
            out["detail_ms_per_step"] = {k: 1e3 * v / steps for k, v in self.detail.items()}
        return out


def _store_gather(store) -> float:
    stats = getattr(store, "stats", None)
    return stats.gather_s if stats is not None else 0.0
