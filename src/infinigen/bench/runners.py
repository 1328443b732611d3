"""Running one system on one cell: a policy on a placement (ours), or transformers with its DynamicCache;
a shared prefill replayed into every system's session; the sweep over (prompt length, batch size)."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import time
from dataclasses import dataclass, field

import torch

from .. import runtime
from ..placement import Placement, TransferStats
from ..placement.timing import Breakdown
from ..memory import MemoryProbe, kv_bytes, tensor_bytes, weight_bytes
from .models import prompt_tokens
from .report import add_ratios


@dataclass
class System:
    """One line of the plots: a policy on a placement, or transformers with one of its caches."""
    label: str
    policy: object = None  # a Policy (ours) or None (transformers)
    kv_offload: str = "none"
    hf_offloading: bool | None = None  # transformers baseline: DynamicCache(offloading=...)
    disk_block: int = 0  # disk tier in blocks of this many tokens (`Placement.disk_block`; 0: the mapped file)
    correct: bool | None = None  # offloaded: the own query corrects the speculation (None: the settings' `correct`)

    @property
    def ours(self) -> bool:
        return self.hf_offloading is None


@dataclass
class BenchSettings:
    prompt_lens: list[int]
    batch_sizes: list[int]
    gen_len: int = 32
    capacity: int | None = None  # pool limit in tokens (a victim is overwritten when full)
    pool_bytes: int | None = None  # pool limit in bytes of the slow tier
    eviction: str = "counter"
    pool_dir: str | None = None
    prefetch: bool = True
    threaded: bool = True
    breakdown_steps: int = 0  # extra instrumented decoding steps for the per-layer time breakdown
    count_ops: bool = False  # one extra decoding step under the torch profiler: its aten operator calls
    weights_offload: float = 0.0  # share of the layers whose weights stream from the slow tier
    share_prefill: bool = False  # one real prefill per cell, replayed into every system's session
    row_cache_bytes: int = 0  # offloaded pools: the row cache (`Placement.row_cache_bytes`; 0: off)
    correct: bool = True  # offloaded pools: the own query corrects the speculation (`Placement.correct`)
    read_in_place: bool = True  # behind a GPU: selections read from pinned host memory (`Placement.read_in_place`)
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ---- models ----------------------------------------------------------------------------------------


class _Record(runtime.Listener):
    """Keeps each layer's prompt queries, keys and values in `tier`."""

    def __init__(self, tier):
        self.tier, self.qkv = tier, []

    def on_prefill(self, layer, q, k, v, session):
        kept = []
        for x in (q, k, v):
            t = self.tier.empty(tuple(x.shape), x.dtype, name=f"p{layer}")
            t.copy_(x)
            kept.append(t)
        self.qkv.append(kept)


class SharedPrefill:
    """One real prefill of a cell's prompts whose per-layer queries, keys and values are kept (in a
    memory-mapped file, or pinned host memory behind a GPU), then replayed into each system's session
    through `Session.begin_prefill` / `prefill_layer`, as `runtime.prefill` writes a session; the
    prompt's attention and MLPs are not recomputed. For long prompts on a CPU, where one prefill takes
    minutes. Every system then decodes from the same state; its prefill latency is the shared one."""

    def __init__(self, model, tokens: torch.Tensor, directory=None):
        from ..placement.tiers import SlowTier
        self.model = model
        fast = model.device
        self.tier = SlowTier("cpu" if fast.type == "cuda" else "disk", fast, directory)
        rec = _Record(self.tier)
        sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1], listeners=[rec])
        tokens = tokens.to(fast)
        _sync(fast)
        t0 = time.perf_counter()
        self.logits = runtime.prefill(model, tokens, sess)
        _sync(fast)
        self.seconds = time.perf_counter() - t0
        self.qkv = rec.qkv
        self.positions, self.valid = sess.positions, sess.prompt_valid
        del sess

    @torch.inference_mode()
    def replay(self, sess) -> torch.Tensor:
        fast = self.model.device
        sess.begin_prefill(self.positions, self.valid)
        for layer, (q, k, v) in enumerate(self.qkv):
            sess.prefill_layer(layer, q.to(fast), k.to(fast), v.to(fast))
        return self.logits

    def close(self) -> None:
        self.qkv.clear()
        self.tier.close()


def _collect(model, batch: int, length: int) -> None:
    """A full garbage collection (half a second with transformers imported) only where a run's memory
    is large enough to matter to the next run's peak."""
    if batch * length > 1 << 13:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_read_bytes() -> int | None:
    """Bytes this process has read from storage (`read_bytes` of /proc/self/io); None where it is missing."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_ours(model, tokens: torch.Tensor, system: System, s: BenchSettings,
             shared: SharedPrefill | None = None) -> dict:
    if not s.weights_offload:
        return _run_ours(model, tokens, system, s, shared=shared)
    from ..placement.weights import WeightStreamer
    kind = "disk" if system.kv_offload == "disk" else "cpu"
    with WeightStreamer(model, s.weights_offload, kind, s.pool_dir) as ws:
        row = _run_ours(model, tokens, system, s, ws, shared)
    return row


def _timed_decode(model, sess, tok: torch.Tensor, steps: int):
    """`steps` greedy decoding steps after `tok`: (every token, `tok` first; the seconds they took; the bytes
    this process read from storage meanwhile, None where unknown)."""
    out = [tok]
    read0 = device_read_bytes()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = runtime.decode(model, tok, sess).argmax(-1)
        out.append(tok)
    _sync(model.device)
    seconds = time.perf_counter() - t0
    return out, seconds, device_read_bytes() - read0 if read0 is not None else None


def _placement(system: System, s: BenchSettings) -> Placement:
    """The placement of `system`'s KV under the sweep's settings."""
    return Placement(system.kv_offload, pool_dir=s.pool_dir, capacity=s.capacity, pool_bytes=s.pool_bytes,
                     evict=s.eviction, prefetch=s.prefetch, threaded=s.threaded,
                     row_cache_bytes=s.row_cache_bytes if system.kv_offload != "none" else 0,
                     disk_block=system.disk_block, correct=s.correct if system.correct is None else system.correct,
                     read_in_place=s.read_in_place and system.kv_offload == "cpu")


def _run_ours(model, tokens: torch.Tensor, system: System, s: BenchSettings, weights=None,
              shared: SharedPrefill | None = None) -> dict:
    b, t = tokens.shape
    device, pol, placement = model.device, system.policy, _placement(system, s)
    max_len = t + s.gen_len + s.breakdown_steps + s.count_ops
    probe = MemoryProbe(device)
    _collect(model, b, max_len)
    probe.reset()
    stats = TransferStats()
    sess = placement.new_session(model, b, max_len, pol, prompt_len=t, stats=stats)
    tokens = tokens.to(device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        logits = runtime.prefill(model, tokens, sess) if shared is None else shared.replay(sess)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        replay_s = None
        if shared is not None:
            prefill_s, replay_s = shared.seconds, prefill_s
        stats.reset()
        w_moved = weights.bytes_moved if weights is not None else 0
        sess.stats.reset()  # the relative KV size (and the rows read) of decoding only
        out, decode_s, device_read = _timed_decode(model, sess, logits.argmax(-1), s.gen_len - 1)
        tok = out[-1]
        steps = s.gen_len - 1
        stats.settle(wait=True)  # behind a GPU: the on-demand counts still on their way
        generated = torch.stack(out, 1).cpu()
        store = sess.store
        slow = store.slow_bytes()
        kv_full = kv_bytes(model.cfg, b, store.capacity, model.dtype)
        spec = [i for i in range(model.cfg.num_layers) if pol.selects(i)]
        state = pol.fast_tier_bytes(sess.state)
        fast_weights = weight_bytes(model) if weights is None else (
            weight_bytes(model) - weights.slow_bytes + weights.fast_buffer_bytes())
        fast_tracked = fast_weights + sum(state.values()) + store.peak_fast_bytes()
        row = {
            "system": system.label, "policy": pol.name, "exact": pol.exact, "settings": pol.settings(model),
            "kv_offload": system.kv_offload, "batch": b, "prompt_len": t,
            "gen_len": s.gen_len, "prefill_s": prefill_s, "prefill_shared": shared is not None,
            "prefill_replay_s": replay_s, "decode_s": decode_s,
            "decode_ms_per_step": 1e3 * decode_s / max(steps, 1),
            "decode_tokens_per_s": b * steps / decode_s if decode_s > 0 else None,
            "bytes_moved_per_token": stats.bytes_moved / (b * steps) if steps else None,
            "fetch_on_demand": stats.on_demand, "fetch_stale": stats.stale, "fetch_jobs": stats.fetches,
            "fetch_wait_ms_per_step": 1e3 * stats.wait_s / max(steps, 1),
            "gather_ms_per_step": 1e3 * (stats.gather_s + stats.ondemand_s) / max(steps, 1),
            "peak_fast_bytes": probe.peak() if device.type == "cuda" else fast_tracked,
            "peak_fast_bytes_tracked": fast_tracked,
            "peak_rss_bytes": probe.peak() if device.type != "cuda" else None,
            "peak_slow_bytes": slow,
            "pool_file_bytes": store.pool_file_bytes(),
            "pool_capacity_tokens": store.capacity,
            "kv_bytes_full": kv_full,
            "weight_bytes_fast": fast_weights,
            "staging_bytes": store.peak_fast_bytes() if store.offloaded else 0,
            "relative_kv": sess.stats.overall(),
            "relative_kv_speculated": sess.stats.overall(spec) if spec else None,
            # summed over layers, batch rows and KV heads: entries attended, and the rows of keys (as many of
            # values) attention read from the store for them (a gather's padding included)
            **{f"{k}_per_step": v for k, v in sess.stats.per_step().items()},
            "tokens_sha1": hashlib.sha1(generated.numpy().tobytes()).hexdigest()[:12],
            # what this process read from storage while decoding (/proc/self/io: every thread, page cache misses)
            "device_read_bytes_per_step": device_read / max(steps, 1) if device_read is not None else None,
            "slow_bytes_read_per_step": stats.bytes_moved / max(steps, 1),
            "disk_block": system.disk_block,
            "blocks_read_per_step": stats.blocks / max(steps, 1),
        }
        tok = _add_extras(row, model, sess, s, stats, weights, w_moved, kv_full, tok)
        row["_tokens"] = generated
        return row
    finally:
        placement.close(sess)
        del sess
        _collect(model, b, max_len)


def _add_extras(row: dict, model, sess, s: BenchSettings, stats: TransferStats, weights, w_moved: int,
                kv_full: int, tok: torch.Tensor) -> torch.Tensor:
    """The row's optional parts: the row cache, streamed weights, the speculation's memory, the per-layer
    breakdown and the aten calls (extra steps after the timed ones); returns the last token decoded."""
    b, steps, store, pol = row["batch"], s.gen_len - 1, sess.store, sess.policy
    if store.offloaded:  # the correction: rows the layers' own selections read that the prefetch missed
        row.update(fetch_missed_rows=stats.missed, ondemand_ms_per_step=1e3 * stats.ondemand_s / max(steps, 1),
                   fetch_missed_share_per_step=stats.missed_shares())
    if getattr(store, "row_cache", None) is not None:  # per step: hits / distinct rows selected, rows fetched
        steps_rc = stats.row_steps
        row["row_cache_bytes"] = store.row_cache.budget
        row["row_cache_hit_rate"] = stats.hit_rate()
        row["row_cache_hit_rate_per_step"] = [h / n if n else None for h, n, _, _ in steps_rc]
        row["slow_rows_fetched_per_step"] = [r for _, _, r, _ in steps_rc]
    if weights is not None:
        row["weights_offload"] = weights.fraction_of_weights()
        row["weight_bytes_moved_per_token"] = (weights.bytes_moved - w_moved) / (b * steps) if steps else None
        row["weight_fast_buffer_bytes"] = weights.fast_buffer_bytes()
        row["weight_slow_bytes"] = weights.slow_bytes
    mem = pol.memory_report(model, sess.state, kv_full)
    if mem:
        row["speculation_memory"] = mem
        row["speculation_bytes"] = mem.get("speculation_bytes")
    if s.breakdown_steps:
        with Breakdown(model, sess) as bd:
            for _ in range(s.breakdown_steps):
                tok = bd.step(tok).argmax(-1)
        row["breakdown"] = bd.summary()
    if s.count_ops:
        row["aten_calls_per_step"], row["aten_calls_top_per_step"] = aten_calls(model, sess, tok)
    return tok


def aten_calls(model, session, token) -> tuple[int, int]:
    """(all aten operator calls, the top-level ones: not called from another aten operator) of one decoding
    step, from the torch profiler's events (a compiled part's kernels are not aten calls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runtime.decode(model, token, session)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(events), len(top)


def run_transformers(hf_model, tokens: torch.Tensor, system: System, s: BenchSettings) -> dict:
    from transformers import DynamicCache
    device = hf_model.device
    b, t = tokens.shape
    tokens = tokens.to(device)
    probe = MemoryProbe(device)
    _collect(hf_model, b, t)
    probe.reset()
    cache = DynamicCache(offloading=bool(system.hf_offloading))
    with torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = hf_model(input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        tok = out.logits[:, -1].argmax(-1)
        gen = [tok]
        t0 = time.perf_counter()
        for _ in range(s.gen_len - 1):
            out = hf_model(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            gen.append(tok)
        _sync(device)
        decode_s = time.perf_counter() - t0
    steps = s.gen_len - 1
    generated = torch.stack(gen, 1).cpu()
    kv = sum(tensor_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)]) for layer in cache.layers)
    tracked = weight_bytes(hf_model) + kv
    del cache, out
    _collect(hf_model, b, t)
    return {"system": system.label, "policy": "transformers", "kv_offload": "cpu" if system.hf_offloading else "none",
            "batch": b, "prompt_len": t, "gen_len": s.gen_len, "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_ms_per_step": 1e3 * decode_s / max(steps, 1),
            "decode_tokens_per_s": b * steps / decode_s if decode_s > 0 else None,
            "peak_fast_bytes": probe.peak() if device.type == "cuda" else tracked, "peak_fast_bytes_tracked": tracked,
            "peak_rss_bytes": probe.peak() if device.type != "cuda" else None,
            "relative_kv": 1.0, "tokens_sha1": hashlib.sha1(generated.numpy().tobytes()).hexdigest()[:12],
            "_tokens": generated}


def sweep(model, systems: list[System], settings: BenchSettings, tokenizer=None, text: str | None = None,
          hf_model=None, progress=None, around_prefill=None) -> list[dict]:
    """Every system at every (prompt length, batch size); rows in that order. `around_prefill`: a
    context manager factory wrapped around each shared prefill (a memory bound steps aside for it)."""
    for system in systems:
        if system.ours:
            system.policy = system.policy.prepare(model, tokenizer, batch=max(settings.batch_sizes))
    rows = []
    for t in settings.prompt_lens:
        for b in settings.batch_sizes:
            tokens = prompt_tokens(tokenizer, text, b, t, model.cfg.vocab_size, settings.seed)
            shared = None
            if settings.share_prefill and any(sy.ours for sy in systems):
                if progress:
                    progress(f"prompt {t} x batch {b}: shared prefill")
                with (around_prefill or contextlib.nullcontext)():
                    shared = SharedPrefill(model, tokens, settings.pool_dir)
            try:
                for system in systems:
                    if progress:
                        progress(f"prompt {t} x batch {b}: {system.label}")
                    if system.ours:
                        row = run_ours(model, tokens, system, settings, shared)
                    else:
                        if hf_model is None:
                            continue
                        row = run_transformers(hf_model, tokens, system, settings)
                    rows.append(row)
            finally:
                if shared is not None:
                    shared.close()
    add_ratios(rows)
    return rows
