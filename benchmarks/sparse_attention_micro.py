"""One selecting layer of a decoding step at the long case's shape, its pieces timed
alone on synthetic tensors: the 4-bit speculation scores, the selection (InfiniGen's default preset: the cap
pooled over the layer's KV heads), then the rows read and attended, on the reference path (`KVStore.slots` +
`gather` + `attend_step`: each KV head padded to the largest head's count) and on the packed rows
(`KVStore.select_rows` + `gather_rows` + one masked fused call) and by the fused C++ kernel
(`kernels/fused_select`, where it builds), beside dense attention over every entry; and the selection, the
packing and the remainder's log-sum-exp in torch against the one C++ call that makes all three
(`fused_select.select_packed`).
Scores are drawn so that about a third of the entries pass the threshold and the cap binds; `--skew`
makes the KV heads' shares unequal (as a real layer's are). Runs from main's checkout too (the reference
pieces only), for a before/after of the selection.

    python benchmarks/sparse_attention_micro.py --length 8192 --batch 8 --threads 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from infinigen import runtime
from infinigen.cache import KVStore
from infinigen.kernels.int4 import PackedKeys
from infinigen.policies.infinigen import InfiniGen
from infinigen.policies.cuts import remainder_lse

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the padded reference lives with the tests
from support.padded_reference import attend_step, gather  # noqa: E402
from support.padded_reference import slots as padded_slots  # noqa: E402


CLOCK = time.perf_counter  # --clock cpu: time.thread_time, the CPU time of this thread (with --threads 1 every
# piece runs in it): what a loaded machine's preemption does not inflate


def _time(fn, reps: int) -> float:
    """The lower quartile of `reps` calls, ms (a shared CPU: the least disturbed calls)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    ts.sort()
    return 1e3 * ts[len(ts) // 4]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skew", type=float, default=2.0, help="score spread of KV head 0 over head 2's")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: this thread's CPU time (needs --threads 1), for a machine other jobs load")
    a = ap.parse_args()
    if a.clock == "cpu":
        if a.threads != 1:
            raise SystemExit("--clock cpu measures one thread: use --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    b, hkv, g, d, s = a.batch, 3, 3, 64, a.length  # SmolLM2-135M: 9 query heads over 3 KV heads, d 64
    dt, scale = torch.bfloat16, d ** -0.5
    store = KVStore(1, b, hkv, s + 64, d, dt)
    k, v = torch.randn(b, hkv, s, d, dtype=dt), torch.randn(b, hkv, s, d, dtype=dt)
    store.write_prompt(0, k, v, torch.ones(b, s, dtype=torch.bool), torch.arange(s).expand(b, s))
    keys = PackedKeys(b, hkv, s + 64, d)
    keys.write(0, k.float())
    q = torch.randn(b, hkv * g, 1, d, dtype=dt)
    kc, vc = torch.randn(b, hkv, 1, d, dtype=dt), torch.randn(b, hkv, 1, d, dtype=dt)
    pol = InfiniGen(preset="flat")  # alpha 7, a 14% cap pooled over the layer ("layer"), min 32
    spread = torch.linspace(a.skew, 1.0, hkv).view(1, hkv, 1, 1, 1)
    scores = torch.randn(b, hkv, g, 1, s) * 2 * spread  # ~1/3 within alpha of each head's max
    valid = store.valid[0][:, :, :s]
    out = {"scores": _time(lambda: keys.scores(q.view(b, hkv, g, d).float(), s), a.reps),
           "selection (threshold + cap)": _time(lambda: pol._choose(scores.clone(), valid[:, :, None], pol.alpha,
                                                                    s, pol.max_fetch_ratio), a.reps)}
    keep = pol._choose(scores.clone(), valid[:, :, None], pol.alpha, s, pol.max_fetch_ratio)[:, :, 0]
    kept, idx, mask, counts = padded_slots(store, 0, keep, valid)
    kp, vp = gather(store, 0, idx)
    out["reference: slots"] = _time(lambda: padded_slots(store, 0, keep, valid), a.reps)
    out["reference: gather"] = _time(lambda: gather(store, 0, idx), a.reps)
    out["reference: attend_step"] = _time(lambda: attend_step(q, kp, vp, mask, kc, vc, scale), a.reps)
    rows = {"entries attended": int(counts.sum()), "reference rows read": idx.numel()}
    if hasattr(store, "select_rows"):
        from infinigen.runtime.attention import StepBuffers, head_mask, with_own
        buffers, slots = StepBuffers(), torch.full((b, hkv), s)
        sel = store.select_rows(0, keep, valid)
        full, head = with_own(sel, slots, store.capacity)
        mask_h = head_mask(head, hkv * g, hkv)
        kr, vr = store.gather_rows(0, full, *buffers.rows(full.numel(), kc))
        out["packed: select_rows"] = _time(lambda: store.select_rows(0, keep, valid), a.reps)
        out["packed: gather_rows"] = _time(lambda: store.gather_rows(0, full, *buffers.rows(full.numel(), kc)),
                                           a.reps)
        out["packed: head mask + attend_masked"] = _time(
            lambda: runtime.attend_masked(q, kr, vr, head_mask(head, hkv * g, hkv), scale), a.reps)
        rows["packed rows read"] = sel.rows.numel()
        try:
            from infinigen.kernels import fused_select
        except ImportError:  # main's checkout before the fused kernel
            fused_select = None
        rest_ref = lambda: remainder_lse(scores, valid[:, :, None] & ~keep[:, :, None])  # noqa: E731
        out["remainder: unread log-sum-exp"] = _time(rest_ref, a.reps)
        if fused_select is not None and hasattr(fused_select, "select_packed") and fused_select.available():
            total = pol._layer_total(pol.max_fetch_ratio, s, hkv, s)
            flat = scores[:, :, :, 0].contiguous()
            out["fused: select_packed (C++: threshold, cap, rows, remainder)"] = _time(
                lambda: fused_select.select_packed(flat.clone(), 1.0, pol.alpha, total, store.capacity, True),
                a.reps)
            out["  (the clone of the scores it overwrites)"] = _time(lambda: flat.clone(), a.reps)
            fk, frows, _, fcounts, _ = fused_select.select_packed(flat.clone(), 1.0, pol.alpha, total,
                                                                   store.capacity, True)
            rows["fused selection equals the torch one"] = bool(torch.equal(fk, keep)
                                                                and torch.equal(frows, sel.rows))
        if fused_select is not None and fused_select.usable(q, store.k[0]):
            own = torch.arange(b * hkv).view(b, hkv) * store.capacity + slots
            kf, vf = store.k[0].view(-1, d), store.v[0].view(-1, d)
            out["fused: attend_rows (C++, no gather)"] = _time(
                lambda: fused_select.attend_rows(q.view(b, hkv * g, d), kf, vf, sel.rows, sel.counts, own, scale),
                a.reps)
        del mask_h
    kd, vd, _, _ = store.past(0)
    out["dense attention (attend_all)"] = _time(lambda: runtime.attend_all(q, kd, vd, scale), a.reps)
    print(f"one selecting layer, {s} tokens x batch {b}, {a.threads} thread(s), {a.clock} ms "
          f"(lower quartile of {a.reps}):")
    for name, ms in out.items():
        print(f"  {name:60s} {ms:7.3f}")
    print("  per (batch row, KV head) selected:", counts[0].tolist(), "...;", rows)


if __name__ == "__main__":
    main()
