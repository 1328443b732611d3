"""Where selecting starts to pay: the cached length below which InfiniGen reads every entry (`dense_below`).

Below some length, speculating and gathering the selected rows costs more than the dense attention it saves. Where
that crossing lies depends on the model's shapes, the policy's settings, the machine and how much of the KV the
policy reads, so the default preset measures it once, over the keys and values of real text: the model's own over
the first tokens of the policy's calibration text (one short prefill), laid out to each length measured (`TextKV`;
random keys, whose flat scores make the policy read up to its cap, only where no tokenizer is given: `sample_kv`).
At a cached length, decoding steps of the full cache and of the policy (selecting at every length), interleaved pair
by pair so that a shared machine's load falls on both alike, until the median of their ratios (the policy's time
over the full cache's) is decisively on one side of 1, else every step allowed (`probe`). The lengths are searched
(`find_crossing`): the middle of the range first, then the shortest where the middle is faster, else the longest,
then one step of false position on the difference of the two step times (linear in the length where both are, so it
lands on the crossing) inside the bracket of a slower and a faster length, then bisection (in log length), until a
length is close to 1 or the bracket is narrow. The crossing is the shortest length from which the policy is faster
at every longer length measured (linear between the measured lengths, `crossing_from`); where it is faster nowhere,
the model's whole context. A step's time grows with the cached length for both systems, the full cache's faster, so
the policy's side changes once: the search never times the longest lengths (the costliest steps) unless the crossing
lies there, nor the shortest unless it lies below the middle. The result is stored as a small JSON file in the
cache, keyed by the model's fingerprint, its dtype and weight kinds, the policy's settings, the machine (CPU or GPU
model, threads, torch) and the KV measured over (the text, its token count and ids), so later runs read it back; a
file that does not parse, or was written for another key, is ignored and measured again.

Measured at batch 1, and also at a run's batch where the run decodes a fixed batch (`generate`, `bench`; a
server's requests decode as sessions of one row each): the policy gains more per step with more rows (its
per-step overhead is shared), so the crossing of a single request is the latest, and reading densely below it is
never slower at any batch. A session of B rows reads densely below the crossing measured at the largest batch
not above B (`InfiniGen.begin`), so every row of one session decides alike, and a row's output depends on the
batch only in a run that fixed it. The batch's crossing is measured only at the lengths the run reaches and
where two sessions of that batch fit easily in the device's memory. Measured with the KV in fast memory: the
policy applies it there only; an offloaded store selects at every length unless the caller sets `dense_below`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

from .. import machine
from ..errors import UserError
from ..kernels import native_key
from ..paths import cache_dir, write_atomic

FORMAT = 3  # how a stored record was measured (over the KV of real text, `TextKV`): another format is remeasured
# the range searched, as shares of the model's context (at most MAX_LENGTH): from the chat case's 512 tokens to the
# whole of SmolLM2's 8192, its middle a quarter
SHARES = (1 / 16, 1 / 4, 1.0)
MAX_LENGTH = 32768
MIN_CONTEXT = 1024  # a model with fewer positions is not measured: it selects at every length
MIN_TEXT = 64  # tokens of text the KV is tiled from at least (else random KV: `sample_kv`)
WARMUP, STEPS = 1, 7  # decoding steps per system and length: not timed, then at most this many timed pairs
MIN_PAIRS = 3  # timed pairs a length takes at least: their median ratio decides its side
DECISIVE = 0.15  # |log ratio| from which a length's side is decided after MIN_PAIRS (the median of its pairs)
CLOSE = 0.05  # |log ratio| under which a length (timed in full) is at the crossing, either side costing the same
NARROW = 1.25  # the search stops once its bracket's longer length is within this factor of its shorter one
MAX_PROBES = 6  # lengths measured at most


def _machine() -> dict:
    cpu, flags = machine.cpu_name(), machine.cpu_flags()
    out = {"cpu": cpu, "cpu_flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12],
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def _weights(model) -> list[str]:
    """The kinds of modules holding the weights (int4 or int8 linears, dense ones): the same checkpoint runs at
    another speed with other kinds, which the fingerprint (a hash of dequantized values) does not tell."""
    return sorted({type(m).__name__ for m in model.modules() if not list(m.children())})


def crossing_key(model, policy, batch: int = 1, lengths: list[int] | None = None, kv=None) -> dict:
    """Everything the crossing depends on: the model, the policy's settings but `dense_below` itself, the machine,
    the batch measured (and, at a batch above 1, the lengths), the KV decoded over (`sample_kv`; None: random)."""
    from ..skew import key_fingerprint
    settings = {k: v for k, v in policy.settings(model).items() if k not in ("dense_below", "calibration",
                                                                            "crossing", "dense_below_source")}
    return {"format": FORMAT, "fingerprint": key_fingerprint(model), "dtype": str(model.dtype),
            "device": str(model.device),
            "weights": _weights(model), "compiled": getattr(model, "step_parts", None) is not None,
            "policy": json.loads(json.dumps(settings, sort_keys=True, default=str)), "batch": batch,
            "machine": _machine(), "kernel": native_key(), "kv": "random" if kv is None else kv.describe()} | (
                {"lengths": lengths} if batch > 1 else {})


def _path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "crossing" / f"{digest}.json"


def load(key: dict) -> dict | None:
    """The stored measurement for `key`, or None: none, unreadable, written for another key, or not a crossing."""
    try:
        stored = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    below = stored.get("dense_below")
    if not isinstance(below, int) or isinstance(below, bool) or not 0 <= below <= MAX_LENGTH:
        return None
    return stored


def store(key: dict, record: dict) -> None:
    """Write the record atomically (a temporary file renamed into place); a cache that cannot be written keeps
    nothing: the next run measures again."""
    try:
        write_atomic(_path(key), json.dumps({**record, "key": key}, indent=1))
    except UserError:
        pass


def lengths_for(model) -> list[int]:
    """The cached lengths measured: shares of the model's context, leaving room for the decoding steps."""
    ctx = min(model.cfg.max_position, MAX_LENGTH) - (WARMUP + STEPS + 1)
    return sorted({max(16, int(ctx * s)) for s in SHARES})


class TextKV:
    """The queries, keys and values each layer computes over the tokens `ids` of a real text (one prefill of the
    full cache, `capture`, on first use), laid out to any cached length (`at`): the prompt itself, then its tokens
    after the first repeated in order, each placed at its new position. A rotary model's keys and queries are
    stored rotated, so a token moved by `delta` positions is rotated by `delta` once more (a rotation by p then by
    delta is one by p + delta): a decoding query then scores every copy at its true distance, near copies as near
    tokens, far ones as far. The first token is not repeated: a model's first token is its attention sink, and
    one sink is what a real prompt has. Real keys give the peaked scores of real text, so the policy reads the
    share of the KV it reads on text (SmolLM2-135M at 8183 x 8: 3.8% from 511 tokens of its calibration text;
    4.4% on a real 8176-token prompt, 5.2% on the bench's 8; random keys give flat scores: 6.8%, its cap)."""

    def __init__(self, text: str, ids: torch.Tensor):
        self.text, self.ids, self.layers = text, ids, None
        self.count = ids.shape[1]

    def describe(self) -> dict:
        """What the KV is, for the crossing's key (known without the prefill)."""
        return {"text": self.text, "tokens": self.count,
                "ids": hashlib.sha256(self.ids.numpy().tobytes()).hexdigest()[:16]}

    def capture(self, model) -> None:
        """The prefill whose KV `at` lays out (once)."""
        if self.layers is not None:
            return
        from ..placement import Placement
        from ..runtime import Listener, prefill
        from .base import FullCache

        class Keep(Listener):
            def __init__(self):
                self.kv = {}

            def on_prefill(self, layer, q, k, v, session):
                self.kv[layer] = (q.clone(), k.clone(), v.clone())

        keep = Keep()
        sess = Placement().new_session(model, 1, self.count, FullCache(), listeners=[keep])
        try:
            with torch.inference_mode():
                prefill(model, self.ids.to(model.device), sess)
        finally:
            sess.store.close()
        self.layers = [keep.kv[i] for i in range(model.cfg.num_layers)]

    def at(self, model, layer: int, length: int, batch: int):
        """`layer`'s queries, keys and values at `length` cached tokens, [batch, heads, length, d] each (every
        row the same)."""
        self.capture(model)
        t = torch.arange(length, device=model.device)
        source = torch.where(t < self.count, t, 1 + (t - 1) % (self.count - 1))
        q, k, v = (x[:, :, source] for x in self.layers[layer])
        if model.cfg.uses_rope and length > self.count:
            rope = model.layers[layer].own_rope(model.rope((t - source)[None]))
            q, k = rope.apply(q), rope.apply(k)
        return [x.expand(batch, -1, -1, -1) for x in (q, k, v)]


class RandomKV:
    """Random queries, keys and values, the same in every layer (no tokenizer to read a text with): flat
    scores, so the policy reads up to its cap (more than on text: the crossing found is later)."""

    def __init__(self, gen: torch.Generator):
        self.gen, self.made = gen, {}

    def describe(self) -> str:
        return "random"

    def at(self, model, layer: int, length: int, batch: int):
        if (length, batch) not in self.made:
            cfg = model.cfg
            self.made = {(length, batch): [torch.randn(batch, h, length, cfg.head_dim, generator=self.gen).to(
                model.device, model.dtype) for h in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)]}
        return self.made[(length, batch)]


# the KV a measurement decodes over, per model, text and length: captured once per process
_TEXT_KV: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def sample_kv(model, policy, tokenizer, count: int):
    """The KV the crossing is measured over: the first `count` tokens of the policy's calibration text
    (`TextKV`, captured once per model, text and count in a process), else random (`RandomKV`: no tokenizer,
    or a text of fewer than MIN_TEXT tokens)."""
    from ..paths import load_text
    from .calibrate import calibration_tokens
    from .infinigen_settings import CALIBRATE_TEXT
    if tokenizer is not None:
        text = getattr(policy, "calibrate_text", None) or CALIBRATE_TEXT
        memo = _TEXT_KV.setdefault(model, {})
        if (text, count) not in memo:
            ids = calibration_tokens(tokenizer, load_text(text), count)
            memo[(text, count)] = TextKV(text, ids) if ids.shape[1] >= MIN_TEXT else None
        if memo[(text, count)] is not None:
            return memo[(text, count)]
    return RandomKV(torch.Generator().manual_seed(0))


def sessions(model, policies: list, length: int, kv, batch: int, steps: int) -> list:
    """One session per policy whose store holds `kv` (`TextKV` or `RandomKV`) at `length` cached tokens in every
    layer (written as a prefill writes them, so the policy packs its speculation keys as it would), ready to
    decode `steps`."""
    from ..placement import Placement
    out = [Placement().new_session(model, batch, length + steps + 1, p) for p in policies]
    positions = torch.arange(length, device=model.device).expand(batch, length)
    with torch.inference_mode():
        for sess in out:
            sess.begin_prefill(positions, torch.ones(batch, length, dtype=torch.bool, device=model.device))
        for layer in range(model.cfg.num_layers):
            q, k, v = kv.at(model, layer, length, batch)
            for sess in out:
                sess.prefill_layer(layer, q, k, v)
    if isinstance(kv, RandomKV):
        kv.made.clear()  # copied into the stores: not held while they decode
    return out


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def step_pairs(model, policy, length: int, gen: torch.Generator, batch: int = 1, steps: int = STEPS, kv=None):
    """At `length` cached tokens of `kv` (`sample_kv`; None: random) in `batch` rows: yields (full cache ms,
    policy ms) per decoding step, at most `steps` pairs, after WARMUP untimed steps of each; the two systems'
    steps interleaved (A B, B A, ...: a drift in load falls on both)."""
    from ..runtime import decode
    from .base import FullCache
    sessions_ = sessions(model, [FullCache(), policy], length, kv or RandomKV(gen), batch, WARMUP + steps)
    token = torch.randint(0, model.cfg.vocab_size, (batch,), generator=gen).to(model.device)
    for step in range(WARMUP + steps):
        times = [0.0, 0.0]
        for i in ((0, 1) if step % 2 == 0 else (1, 0)):
            _sync(model)
            s0 = time.perf_counter()
            decode(model, token, sessions_[i])
            _sync(model)
            times[i] = 1e3 * (time.perf_counter() - s0)
        if step >= WARMUP:
            yield times[0], times[1]


def probe(pairs) -> dict:
    """One length's measurement from its (full ms, policy ms) pairs: pairs are taken until the median of their
    ratios is decided (beyond DECISIVE from 1) after at least MIN_PAIRS, or the pairs end (a length near the
    crossing is timed in full: a few pairs of a loaded machine put it on either side). Returns {"full_ms",
    "policy_ms": medians, "ratio": the median ratio, "pairs": how many}."""
    full, pol, ratio = [], [], []
    try:
        for f, p in pairs:
            full.append(f)
            pol.append(p)
            ratio.append(p / f)
            if len(ratio) >= MIN_PAIRS and abs(math.log(statistics.median(ratio))) >= DECISIVE:
                break
    finally:
        getattr(pairs, "close", lambda: None)()  # the generator's sessions are freed now
    if not ratio:
        raise ValueError("no decoding step was timed")
    return {"full_ms": statistics.median(full), "policy_ms": statistics.median(pol),
            "ratio": statistics.median(ratio), "pairs": len(ratio)}


def find_crossing(pairs_at, lo: int, hi: int, context: int, log=None, batch: int = 1) -> dict:
    """Search the lengths from `lo` to `hi` for the crossing (see the module docstring): `pairs_at(n)` gives the
    (full ms, policy ms) pairs at n cached tokens (`step_pairs`). Returns {"lengths" (those measured, ascending),
    "full_ms", "policy_ms", "ratio", "pairs" (per length), "dense_below"}."""
    seen: dict[int, dict] = {}

    def at(n: int) -> dict:
        if n not in seen:
            seen[n] = probe(pairs_at(n))
            if log:
                log(f"  crossing: {n} cached tokens x {batch}: full cache {seen[n]['full_ms']:.1f} ms/step, selecting "
                    f"{seen[n]['policy_ms']:.1f} (x{seen[n]['ratio']:.2f}, {seen[n]['pairs']} pairs)")
        return seen[n]

    def close(n: int) -> bool:
        return abs(math.log(seen[n]["ratio"])) < CLOSE

    mid = max(lo, min(hi, int(round(math.sqrt(lo * hi)))))
    if at(mid)["ratio"] < 1:  # faster at the middle: the crossing lies below it
        at(lo)
        a, b = lo, mid
    elif hi != mid and at(hi)["ratio"] < 1:
        a, b = mid, hi
    else:
        a = b = None  # slower at the longest length: never pays
    narrowed = False  # the bracket moved once already: bisect from then on
    if a is not None and seen[a]["ratio"] >= 1 and not close(a) and not close(b):
        while b / a > NARROW and len(seen) < MAX_PROBES:
            # first false position on the difference of the step times (policy - full: > 0 at a, < 0 at b):
            # where both are linear it lands on the crossing, which the stop above ends on; where it did not
            # (a cost that bends or jumps, on which false position creeps), the bracket's middle in log length
            da, db = (seen[n]["policy_ms"] - seen[n]["full_ms"] for n in (a, b))
            x = a + (b - a) * da / (da - db) if da > db and not narrowed else math.sqrt(a * b)
            edge = (b / a) ** 0.1
            x = int(round(min(max(x, a * edge), b / edge)))
            if x in seen or not a < x < b:
                break
            at(x)
            if close(x):
                break
            slower = seen[x]["ratio"] >= 1
            a, b = (x, b) if slower else (a, x)
            narrowed = True
    lengths = sorted(seen)
    out = {k: [round(seen[n][k], 4 if k == "ratio" else 3) for n in lengths] for k in ("full_ms", "policy_ms",
                                                                                       "ratio")}
    return {"lengths": lengths, **out, "pairs": [seen[n]["pairs"] for n in lengths],
            "dense_below": crossing_from(lengths, [seen[n]["ratio"] for n in lengths], context)}


def measure(model, policy, lengths: list[int] | None = None, steps: int = STEPS, log=None, batch: int = 1,
            kv=None) -> dict:
    """Where selecting pays, searched over the lengths from the shortest to the longest of `lengths`
    (`find_crossing`), each measured by at most `steps` interleaved decoding steps of the full cache and of
    `policy` selecting at every length over `kv` (`sample_kv`; None: random) in `batch` rows. Returns
    {"lengths", "full_ms", "policy_ms", "ratio", "pairs", "dense_below", "seconds"} ("seconds": the whole
    measurement's, `kv`'s capture on first use included)."""
    t0 = time.perf_counter()
    lengths = sorted(lengths or lengths_for(model))
    selecting = dataclasses.replace(policy, dense_below=0, calibrate=False)
    if getattr(policy, "matrices", None) is not None:
        selecting.with_skew(policy.matrices)
    gen = torch.Generator().manual_seed(0)
    found = find_crossing(lambda n: step_pairs(model, selecting, n, gen, batch, steps, kv), lengths[0], lengths[-1],
                          model.cfg.max_position, log, batch)
    return {**found, "seconds": round(time.perf_counter() - t0, 2)}


def crossing_from(lengths: list[int], ratio: list[float], context: int) -> int:
    """The shortest cached length from which selecting is faster (ratio < 1: its time over the full cache's) at
    every measured length beyond: linear in the length between two measured points, and before the first one
    along the line through the first two (at least 0). Faster at none of them, or only at some shorter lengths
    with a longer one slower: the model's whole context (never select)."""
    first = len(ratio)
    while first > 0 and ratio[first - 1] < 1:
        first -= 1
    if first == len(ratio):
        return min(context, MAX_LENGTH)
    if first == 0:
        if len(ratio) < 2 or ratio[1] >= ratio[0]:
            return lengths[0]  # no slope to follow below the first length: read densely there
        (a, ra), (b, rb) = (lengths[0], ratio[0]), (lengths[1], ratio[1])
    else:
        (a, ra), (b, rb) = (lengths[first - 1], ratio[first - 1]), (lengths[first], ratio[first])
    at = a + (ra - 1) * (b - a) / (ra - rb)  # where the line through the two points reaches 1
    return max(0, min(b, int(round(at))))


def measure_crossing(model, policy, log=None, remeasure: bool = False, longest: int | None = None,
                     batch: int = 1, tokenizer=None) -> dict:
    """The crossing for this model, policy, machine and batch: stored before (source "cached"), else measured now
    and stored (source "measured"); a model shorter than MIN_CONTEXT positions is not measured (0, select at every
    length). `remeasure`: measure even when stored (`infinigen calibrate` may call it so). `longest`: the most
    tokens a session of this run caches; under the shortest length measured nothing is measured (a short chat's
    first token does not wait for it) and the run reads densely, which is exact and costs nothing there. At a
    `batch` above 1 only the lengths the run reaches are measured (`batch_lengths`); None where none is. The KV
    decoded over: the policy's calibration text's with `tokenizer`, else random (`sample_kv`)."""
    if model.cfg.max_position < MIN_CONTEXT:
        return {"dense_below": 0, "source": f"not measured (a model of {model.cfg.max_position} positions: "
                                            f"under {MIN_CONTEXT})"}
    lengths = lengths_for(model) if batch == 1 else batch_lengths(model, batch, longest)
    if not lengths:
        return None
    kv = sample_kv(model, policy, tokenizer, lengths_for(model)[0])
    key = crossing_key(model, policy, batch, lengths, kv)
    if not remeasure:
        stored = load(key)
        if stored is not None:
            return {**{k: v for k, v in stored.items() if k != "key"}, "source": "cached"}
    shortest = lengths[0]
    if longest == 0 and not remeasure:
        return {"dense_below": shortest, "source": "not measured (it is measured by the first run that caches "
                                                   f"{shortest} tokens, in that run's dtype, weights and compilation)"}
    if longest is not None and longest < shortest and not remeasure:
        return {"dense_below": shortest, "source": f"not measured (this run caches at most {longest} tokens, under "
                                                   f"the shortest length measured, {shortest}: it reads densely)"}
    if log:
        over = f"{kv.count} tokens of {kv.text} laid out to each length" if isinstance(kv, TextKV) else "random KV"
        log(f"measuring where InfiniGen's selection pays on this machine at batch {batch} (a few decoding steps "
            f"over {over})")
    record = measure(model, policy, lengths=lengths, log=log, batch=batch, kv=kv)
    record["date"] = time.strftime("%Y-%m-%d %H:%M")
    store(key, record)
    return {**record, "source": "measured"}


def batch_lengths(model, batch: int, longest: int | None) -> list[int]:
    """The lengths measured at a batch above 1: those of batch 1 that a run caching `longest` tokens reaches
    (the first one always: below it the run reads densely anyway), and only where the measurement's two sessions
    of `batch` rows take at most a quarter of the device's memory."""
    from ..memory import device_memory_bytes, kv_bytes
    lengths = lengths_for(model)
    if longest is not None:
        lengths = lengths[:1] + [n for n in lengths[1:] if n <= longest]
    have = device_memory_bytes(model.device)
    return [n for n in lengths if have is None or 2 * kv_bytes(model.cfg, batch, n, model.dtype) <= have / 4]


# Where selection pays (`dense_below` of the default preset), per model and settings: measured once per process
_CROSSINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def crossing_for(policy, model, progress: bool, longest: int | None = None, batch: int = 1, tokenizer=None) -> dict:
    """Where `policy` (its `dense_below` unset) starts to select on this machine (`measure_crossing`), with
    `dense_below`: stored, else measured now (a few seconds) and stored. Once per model, settings and batch in a
    process. A run that caches fewer tokens than the shortest length measured (`longest`) measures nothing and
    reads densely (not remembered: a longer run in the same process measures). At a `batch` above 1 the record
    also holds `by_batch`: the crossing at batch 1 and at `batch` (where measured), which `InfiniGen.begin`
    chooses from by a session's rows. `tokenizer`: to measure over the KV of real text (`sample_kv`)."""
    found = _crossing_at(policy, model, progress, longest, 1, tokenizer)
    if batch > 1 and found["source"] in ("measured", "cached"):
        wide = _crossing_at(policy, model, progress, longest, batch, tokenizer)
        if wide is not None and wide["source"] in ("measured", "cached"):
            found = {**found, "by_batch": {"1": found["dense_below"], str(batch): wide["dense_below"]},
                     "batch_" + str(batch): {k: v for k, v in wide.items() if k != "source"}}
    return found


def _crossing_at(policy, model, progress: bool, longest: int | None, batch: int, tokenizer) -> dict | None:
    key = json.dumps({k: v for k, v in policy.settings(model).items() if k not in ("dense_below_source", "crossing")},
                     sort_keys=True, default=str) + f"|{batch}|{longest if batch > 1 else ''}|{tokenizer is None}"
    memo = _CROSSINGS.setdefault(model, {})
    if key not in memo:
        found = measure_crossing(model, policy, log=(lambda m: print(m, file=sys.stderr)) if progress else None,
                                 longest=longest, batch=batch, tokenizer=tokenizer)
        if found is None or found["source"].startswith("not measured"):
            return found
        memo[key] = found
        if memo[key]["source"] == "measured" or progress:
            rows = "" if batch == 1 else f" at batch {batch}"
            print(f"InfiniGen reads densely below {memo[key]['dense_below']} cached tokens{rows} "
                  f"({memo[key]['source']}: where its selection pays on this machine)", file=sys.stderr)
    return dict(memo[key])
