"""The relative KV size: what each layer's attention read, per decoding step."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class KVStats:
    """Relative KV size: the fraction of past entries each layer's attention read, per decoding step (of
    those its full cache reads: a sliding-window layer's whole window)."""
    num_layers: int
    read: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget what was recorded (e.g. the prefill's, to measure decoding alone)."""
        self.read = [0.0] * self.num_layers
        self.steps = [0] * self.num_layers
        self.entries = [0] * self.num_layers  # entries attended (selected and valid), summed over rows and steps
        self.rows = [0] * self.num_layers  # rows of keys (and as many of values) attention read from the store
        self._pending = []  # (layer, selected, past): reduced in bulk, off the per-layer decode path

    def record_rows(self, layer: int, rows) -> None:
        """Attention at `layer` read `rows` rows of keys and as many of values from the store (a host number:
        what a gather moved, padding included, or the used slots a dense read covers; or a count on the device,
        `SelectedRows.read`, summed there until it is read)."""
        self.rows[layer] += rows

    def record(self, layer: int, selected: torch.Tensor, past: torch.Tensor, owned: bool = False) -> None:
        """selected [B, Hkv, R] (or [B, Hkv]: one row) entries read and past [B, 1|Hkv, R] tokens before each row.
        `owned`: past is the caller's copy, which nothing changes later (else it is copied: it may be a view of
        live positions)."""
        self._pending.append((layer, selected, past if owned else past.clone()))
        if len(self._pending) >= 2048:
            self._flush()

    def _flush(self) -> None:
        """Fold pending records into `read`/`steps`, one stacked computation per shape."""
        pending, self._pending = self._pending, []
        groups: dict = {}
        for item in pending:
            groups.setdefault((item[1].shape, item[2].shape, item[1].device), []).append(item)
        for items in groups.values():
            sel = torch.stack([s for _, s, _ in items]).float()
            if sel.dim() == 3:  # [L, B, Hkv]: one row each
                sel = sel[..., None]
            past = torch.stack([p for _, _, p in items]).float().clamp(min=1)
            fracs = (sel / past).mean(dim=(1, 2)).sum(-1).tolist()
            totals = sel.sum(dim=(1, 2, 3)).tolist()
            for (layer, s, _), f, n in zip(items, fracs, totals):
                self.read[layer] += f
                self.steps[layer] += s.shape[-1] if s.dim() == 3 else 1
                self.entries[layer] += int(n)

    def record_keys(self, layer: int, keys: torch.Tensor, past: torch.Tensor) -> None:
        """keys [B, Hkv, R] read beside the entries `record` counted for the same rows (a re-rank's candidates),
        past as `record`'s: each a key without its value, half an entry of the relative KV size, half a row."""
        keys = keys.float() if keys.dim() == 3 else keys.float()[..., None]  # [B, Hkv, R]
        past = past.float() if past.dim() == 3 else past.float()[..., None]  # [B, 1|Hkv, R]
        self.read[layer] += 0.5 * (keys / past.clamp(min=1)).mean(dim=(0, 1)).sum().item()
        self.rows[layer] += 0.5 * keys.sum().item()

    def record_all(self, layer: int, batch: int, kv_heads: int, past: int) -> None:
        """One decoding row per batch row read every one of its `past` entries (all valid past tokens)."""
        self.read[layer] += 1.0
        self.steps[layer] += 1
        self.entries[layer] += batch * kv_heads * past

    def per_layer(self) -> list[float]:
        self._flush()
        return [r / s if s else float("nan") for r, s in zip(self.read, self.steps)]

    def per_step(self) -> dict:
        """Per decoding step, summed over the layers: the entries attention attended (selected, every row and
        KV head) and the rows it read from the store to do so (`record_rows`); None before any step."""
        self._flush()
        done = [i for i, s in enumerate(self.steps) if s]
        if not done:
            return {"entries_attended": None, "rows_read": None}
        return {"entries_attended": sum(self.entries[i] / self.steps[i] for i in done),
                "rows_read": float(sum(self.rows[i] / self.steps[i] for i in done))}

    def overall(self, layers=None) -> float:
        vals = [f for i, f in enumerate(self.per_layer()) if (layers is None or i in layers) and not math.isnan(f)]
        return sum(vals) / len(vals) if vals else float("nan")

