"""Speed benchmark: prefill and decode of the same prompts with several KV-cache systems, side by side.

A *system* is a policy on a placement: "ideal" (full cache in fast memory), full offload (FlexGen style:
all of layer i's KV fetched during layer i-1), InfiniGen, H2O, INT4 (packed 4-bit pool), each on the
KV tier asked for (`--kv-offload none,cpu,disk`), plus `transformers` with its DynamicCache (and, on
CUDA, its offloaded DynamicCache) on the same weights. Every row reports prefill latency, decode latency
and throughput, bytes moved slow->fast per generated token, peak fast and slow memory, the relative KV
size, and, for InfiniGen, what its speculation state costs relative to the weights and the KV cache.

`--synthetic NAME` runs a paper-size shape (OPT-6.7B, Llama-3-8B, ...) with random weights; InfiniGen
then fetches a fixed share of the tokens per step (`fixed_ratio`, measure it on the real model with
`infinigen ppl` or a real-model bench), since speculation on random weights says nothing.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field

import torch

from .errors import UserError
from .placement import Placement, TransferStats
from .placement.timing import Breakdown
from .policies.base import Policy, tensor_bytes

# paper-size shapes for --synthetic (random weights): (arch, transformers config fields)
SYNTHETIC = {
    "opt-6.7b": ("opt", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                             word_embed_proj_dim=4096, vocab_size=50272, max_position_embeddings=2048)),
    "opt-13b": ("opt", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
                            word_embed_proj_dim=5120, vocab_size=50272, max_position_embeddings=2048)),
    "opt-30b": ("opt", dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56, ffn_dim=28672,
                            word_embed_proj_dim=7168, vocab_size=50272, max_position_embeddings=2048)),
    "llama-2-7b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                 intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096)),
    "llama-2-13b": ("llama", dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                                  intermediate_size=13824, vocab_size=32000, max_position_embeddings=4096)),
    "llama-3-8b": ("llama", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                                 rope_theta=500000.0)),
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                                   rope_theta=100000.0, tie_word_embeddings=True)),
}


@dataclass
class System:
    """One line of the plots: a policy on a placement, or transformers with one of its caches."""
    label: str
    policy: object = None  # a Policy (ours) or None (transformers)
    kv_offload: str = "none"
    hf_offloading: bool | None = None  # transformers baseline: DynamicCache(offloading=...)

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
    weights_offload: float = 0.0  # share of the layers whose weights stream from the slow tier
    share_prefill: bool = False  # one real prefill per cell, replayed into every system's session
    seed: int = 0
    extra: dict = field(default_factory=dict)


# ---- models ----------------------------------------------------------------------------------------
def synthetic_models(name: str, dtype: torch.dtype, device: str, max_len: int, layers: int | None = None,
                     hf: bool = True):
    """(our model, transformers model sharing its weights, label) for a paper-size shape, random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    from .config import ModelConfig
    from .loading import build
    if name not in SYNTHETIC:
        raise UserError(f"unknown --synthetic shape {name!r}; choose from {', '.join(SYNTHETIC)}")
    arch, kw = SYNTHETIC[name]
    kw = dict(kw)
    if layers:
        kw["num_hidden_layers"] = layers
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_len)  # random weights: any length
    cfg = (OPTConfig(**kw, do_layer_norm_before=True, dropout=0.0, attention_dropout=0.0) if arch == "opt"
           else LlamaConfig(**kw, rms_norm_eps=1e-5, attention_bias=False))
    torch.manual_seed(0)
    with torch.device(device):
        hf_model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    ours = build(ModelConfig.from_hf(cfg), dict(hf_model.state_dict()), dtype=dtype, device=device)  # shared tensors
    label = f"{name} (synthetic random weights, {cfg.num_hidden_layers} layers)"
    return ours, (hf_model if hf else None), label


def hf_model_for(spec: str, dtype: torch.dtype, device: str):
    """The transformers model of a `load` spec ('default', a .gguf file or a checkpoint directory)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from .loading import _convert_gguf, default_gguf
    if spec in (None, "", "default"):
        path = _convert_gguf(default_gguf(), progress=False)
    else:
        path = Path(spec).expanduser()
        if path.is_dir() and not (path / "config.json").exists():
            path = sorted(path.glob("*.gguf"))[0]
        if path.is_file():
            path = _convert_gguf(path, progress=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def prompt_tokens(tokenizer, text: str | None, batch: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[batch, length] token ids: consecutive pieces of `text` (real text keeps the attention pattern,
    hence InfiniGen's selection, realistic), or random ids when there is no text."""
    if text is None or tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(4, vocab, (batch, length), generator=g)
    ids = _tokenized(tokenizer, text)
    need = batch * length
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)  # the text is short: it repeats
    return torch.tensor(ids[:need]).view(batch, length)


_TOKEN_CACHE: dict = {}


def _tokenized(tokenizer, text: str) -> list[int]:
    key = (id(tokenizer), hashlib.sha1(text.encode()).hexdigest())
    if key not in _TOKEN_CACHE:
        _TOKEN_CACHE[key] = list(tokenizer(text)["input_ids"])
    return _TOKEN_CACHE[key]


# ---- memory ----------------------------------------------------------------------------------------
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
class _Record(Policy):
    """Dense attention that keeps each layer's prompt queries, keys and values in `tier`."""
    name = "record"

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
    through `Session.start_prefill` / `prefill_layer`, as `Transformer.prefill` writes a session; the
    prompt's attention and MLPs are not recomputed. For long prompts on a CPU, where one prefill takes
    minutes. Every system then decodes from the same state; its prefill latency is the shared one."""

    def __init__(self, model, tokens: torch.Tensor, directory=None):
        from .placement.tiers import SlowTier
        self.model = model
        fast = model.device
        self.tier = SlowTier("cpu" if fast.type == "cuda" else "disk", fast, directory)
        rec = _Record(self.tier)
        sess = Placement().new_session(model, tokens.shape[0], tokens.shape[1], rec)
        tokens = tokens.to(fast)
        _sync(fast)
        t0 = time.perf_counter()
        self.logits = model.prefill(tokens, sess)
        _sync(fast)
        self.seconds = time.perf_counter() - t0
        self.qkv = rec.qkv
        self.positions, self.valid = sess.positions, sess.prompt_valid
        del sess

    @torch.inference_mode()
    def replay(self, sess) -> torch.Tensor:
        fast = self.model.device
        sess.start_prefill(self.positions, self.valid)
        for layer, (q, k, v) in enumerate(self.qkv):
            sess.prefill_layer(layer, q.to(fast), k.to(fast), v.to(fast))
        return self.logits

    def close(self) -> None:
        self.qkv.clear()
        self.tier.close()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(model, tokens: torch.Tensor, system: System, s: BenchSettings, shared: SharedPrefill | None = None) -> dict:
    if not s.weights_offload:
        return _run_ours(model, tokens, system, s, shared=shared)
    from .placement.weights import WeightStreamer
    kind = "disk" if system.kv_offload == "disk" else "cpu"
    with WeightStreamer(model, s.weights_offload, kind, s.pool_dir) as ws:
        row = _run_ours(model, tokens, system, s, ws, shared)
    return row


def _run_ours(model, tokens: torch.Tensor, system: System, s: BenchSettings, weights=None,
              shared: SharedPrefill | None = None) -> dict:
    b, t = tokens.shape
    device = model.device
    pol = system.policy
    placement = Placement(system.kv_offload, pool_dir=s.pool_dir, capacity=s.capacity, pool_bytes=s.pool_bytes,
                          evict=s.eviction, prefetch=s.prefetch, threaded=s.threaded)
    max_len = t + s.gen_len + s.breakdown_steps
    probe = MemoryProbe(device)
    _collect(model, b, max_len)
    probe.reset()
    stats = TransferStats()
    sess = placement.new_session(model, b, max_len, pol, prompt_len=t, stats=stats)
    tokens = tokens.to(device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        logits = model.prefill(tokens, sess) if shared is None else shared.replay(sess)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        replay_s = None
        if shared is not None:
            prefill_s, replay_s = shared.seconds, prefill_s
        stats.reset()
        w_moved = weights.bytes_moved if weights is not None else 0
        from .model import KVStats
        sess.stats = KVStats(model.cfg.num_layers)  # the relative KV size of decoding only
        tok = logits.argmax(-1)
        out = [tok]
        t0 = time.perf_counter()
        for _ in range(s.gen_len - 1):
            tok = model.decode(tok, sess).argmax(-1)
            out.append(tok)
        _sync(device)
        decode_s = time.perf_counter() - t0
        steps = s.gen_len - 1
        generated = torch.stack(out, 1).cpu()
        store = sess.store
        slow = store.slow_bytes() if hasattr(store, "slow_bytes") else 0
        kv_full = _kv_bytes(model, b, store.capacity)
        spec = [i for i in range(model.cfg.num_layers) if pol.speculated(i)]
        state = pol.fast_tier_bytes(sess.state)
        fast_weights = weight_bytes(model) if weights is None else (
            weight_bytes(model) - weights.slow_bytes + weights.fast_buffer_bytes())
        fast_tracked = fast_weights + sum(state.values()) + (
            stats.peak_fast_bytes if hasattr(store, "slow_bytes") else store.nbytes())
        row = {
            "system": system.label, "policy": pol.name, "settings": pol.settings(model),
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
            "pool_file_bytes": store.tier.files_bytes() if hasattr(store, "tier") else 0,
            "pool_capacity_tokens": store.capacity,
            "kv_bytes_full": kv_full,
            "relative_kv": sess.stats.overall(),
            "relative_kv_speculated": sess.stats.overall(spec) if spec else None,
            "tokens_sha1": hashlib.sha1(generated.numpy().tobytes()).hexdigest()[:12],
        }
        if weights is not None:
            row["weights_offload"] = weights.fraction_of_weights()
            row["weight_bytes_moved_per_token"] = (weights.bytes_moved - w_moved) / (b * steps) if steps else None
            row["weight_fast_buffer_bytes"] = weights.fast_buffer_bytes()
            row["weight_slow_bytes"] = weights.slow_bytes
        mem = pol.memory_report(model, sess.state, kv_full)
        if mem:
            row["speculation_memory"] = mem
        if s.breakdown_steps:
            with Breakdown(model, sess) as bd:
                for _ in range(s.breakdown_steps):
                    tok = bd.step(tok).argmax(-1)
            row["breakdown"] = bd.summary()
        row["_tokens"] = generated
        return row
    finally:
        placement.close(sess)
        del sess
        _collect(model, b, max_len)


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


def add_ratios(rows: list[dict]) -> None:
    """Decode-throughput ratios within each (prompt length, batch) cell: vs transformers' DynamicCache,
    vs ideal, vs full offload on the same tier; and how many generated tokens agree with ideal's."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["prompt_len"], r["batch"]), []).append(r)
    for cell in cells.values():
        ref = {}
        for r in cell:
            if r["policy"] == "transformers" and r["kv_offload"] == "none":
                ref["hf"] = r
            elif r["policy"] == "full" and r["kv_offload"] == "none":
                ref["ideal"] = r
            elif r["policy"] == "full":
                ref.setdefault(("full", r["kv_offload"]), r)
        for r in cell:
            tps = r.get("decode_tokens_per_s")
            if not tps:
                continue
            for key, name in (("hf", "x_vs_transformers"), ("ideal", "x_vs_ideal")):
                if key in ref and ref[key].get("decode_tokens_per_s"):
                    r[name] = tps / ref[key]["decode_tokens_per_s"]
            full = ref.get(("full", r["kv_offload"])) or next((v for k, v in ref.items() if isinstance(k, tuple)), None)
            if full is not None and full.get("decode_tokens_per_s"):
                r["x_vs_full_offload"] = tps / full["decode_tokens_per_s"]
            if "ideal" in ref and "_tokens" in r and "_tokens" in ref["ideal"]:
                r["tokens_agree_with_ideal"] = float((r["_tokens"] == ref["ideal"]["_tokens"]).float().mean())


def sweep(model, systems: list[System], settings: BenchSettings, tokenizer=None, text: str | None = None,
          hf_model=None, progress=None) -> list[dict]:
    """Every system at every (prompt length, batch size); rows in that order."""
    for system in systems:
        if system.ours:
            system.policy.prepare(model, tokenizer)
    rows = []
    for t in settings.prompt_lens:
        for b in settings.batch_sizes:
            tokens = prompt_tokens(tokenizer, text, b, t, model.cfg.vocab_size, settings.seed)
            shared = None
            if settings.share_prefill and any(sy.ours for sy in systems):
                if progress:
                    progress(f"prompt {t} x batch {b}: shared prefill")
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


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def cpu_name() -> str:
    """The CPU model, for naming the machine under a result."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def strip_private(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def write_json(path, payload: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e}")


def plot(rows: list[dict], path, title: str = "") -> None:
    """Decode throughput against batch size (at the longest prompt) and against prompt length (at the
    largest batch), one line per system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    rows = [r for r in rows if r.get("decode_tokens_per_s")]
    if not rows:
        raise UserError("nothing to plot: no run produced a decode throughput")
    systems = list(dict.fromkeys(r["system"] for r in rows))
    t_max = max(r["prompt_len"] for r in rows)
    b_max = max(r["batch"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (xkey, fixed_key, fixed, xlabel) in zip(axes, (
            ("batch", "prompt_len", t_max, "batch size"), ("prompt_len", "batch", b_max, "prompt length (tokens)"))):
        for name in systems:
            pts = sorted((r[xkey], r["decode_tokens_per_s"]) for r in rows if r["system"] == name and r[fixed_key] == fixed)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title(f"{'prompt' if fixed_key == 'prompt_len' else 'batch'} {fixed}")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e}")
    finally:
        plt.close(fig)

