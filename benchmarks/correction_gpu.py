"""Speculation with correction behind a GPU (the KV pool in pinned host memory): what the correction costs a
decoding step when the GPU reads the rows the prefetch missed from the pinned pool itself (the default, no wait
on the main thread) against the host gathering them after one copy of each corrected layer's mask (the main
thread waits once per corrected layer), and against the speculation alone; and every selection read in place
(`Placement.read_in_place`: nothing prefetched, the attention reads the selected rows over the bus), speculated
or corrected, beside full offload. One process, the forms taking turns.

    python benchmarks/correction_gpu.py --synthetic llama-3-8b --layers 8 --prompt-len 8192 --batch 8 \\
        --ratio 0.068 --steps 16 --rounds 3 --json results/gpu/correction_gpu.json

Random weights (a paper-size shape, `infinigen bench --synthetic`): InfiniGen selects a fixed share (`--ratio`) of
the tokens and its speculation one layer ahead agrees with the layer's own query far less than on a trained model,
so the rows fetched on demand are many more than a real model's (results/recall/correction.md: 1-2% of the KV per
step on SmolLM2): a stress of the correction's path, not a measure of its share. The corrected forms read the
same rows (the float32 tests show them equal); in float16 the kernel's split of a run differs between them (the
packed width), so near-tied random logits may round apart: the share of tokens equal to the host-corrected form's
is reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# form -> (InfiniGen or full, Placement keywords, the store's `corrects_on_device`)
FORMS = {"full offload": (False, {}, True),
         "speculation only": (True, {"correct": False, "read_in_place": False}, True),
         "corrected on the host": (True, {"read_in_place": False}, False),
         "corrected on the GPU": (True, {"read_in_place": False}, True),  # the default
         "read in place, speculated": (True, {"correct": False, "read_in_place": True}, True),
         "read in place, corrected": (True, {"read_in_place": True}, True)}


def decode(model, policy, form: str, tokens: torch.Tensor, steps: int) -> dict:
    """One session of `form`: prefill `tokens`, then `steps` greedy steps timed (the GPU synchronized at both ends)."""
    from infinigen import runtime
    from infinigen.placement import Placement
    from infinigen.policies import make_policy
    selects, placement, on_device = FORMS[form]
    pl = Placement("cpu", **placement)
    sess = pl.new_session(model, tokens.shape[0], tokens.shape[1] + steps + 1,
                          policy if selects else make_policy("full"))
    sess.store.corrects_on_device = on_device
    try:
        logits = runtime.prefill(model, tokens, sess)
        out = [logits.argmax(-1)]
        logits = runtime.decode(model, out[-1], sess)  # the first step sizes the fetch buffers
        out.append(logits.argmax(-1))
        st = sess.store.stats
        st.settle(wait=True)
        st.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = runtime.decode(model, out[-1], sess)
            out.append(logits.argmax(-1))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        st.settle(wait=True)
        shares = st.missed_shares()
        return {"ms_per_step": 1e3 * seconds / steps, "tokens": torch.stack(out, 1).cpu(),
                "on_demand_share_mean": statistics.mean(shares) if shares else 0.0,
                "on_demand_share_max": max(shares, default=0.0),
                "rows_from_host_per_step": st.rows_moved / steps, "on_demand_ms_per_step": 1e3 * st.ondemand_s / steps,
                "wait_ms_per_step": 1e3 * st.wait_s / steps, "bytes_from_host_per_step": st.bytes_moved / steps,
                "corrected_on_the_device": sess.store._on_device(), "read_in_place": sess.store._in_place()}
    finally:
        pl.close(sess)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default="llama-3-8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.068)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("correction_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from infinigen.bench import synthetic_models
    from infinigen.policies import make_policy
    model, _, label = synthetic_models(a.synthetic, getattr(torch, a.dtype), "cuda", a.prompt_len + a.steps + 2,
                                       a.layers, hf=False)
    policy = make_policy("infinigen").for_random_weights(model, a.ratio)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (a.batch, a.prompt_len), generator=g).cuda()
    runs: dict = {f: [] for f in FORMS}
    for _ in range(a.rounds):
        for form in FORMS:
            try:
                runs[form].append(decode(model, policy, form, tokens, a.steps))
            except Exception as e:  # one form failing leaves the others' numbers
                print(f"{form}: failed: {e!r}", flush=True)
                runs[form].append({"error": repr(e)})
                continue
            r = runs[form][-1]
            print(f"{form:28s} {r['ms_per_step']:8.2f} ms/step  {r['bytes_from_host_per_step'] / 1e9:6.3f} GB from the "
                  f"host per step, on demand {100 * r['on_demand_share_mean']:.2f}% (max "
                  f"{100 * r['on_demand_share_max']:.2f}%) of the KV per step", flush=True)
    ref = runs["corrected on the host"]
    same = {f: sum(float((x["tokens"] == y["tokens"]).float().mean()) for x, y in zip(ref, runs[f])
                   if "tokens" in x and "tokens" in y) / len(ref)
            for f in ("corrected on the GPU", "read in place, corrected")}
    report = {"model": label, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "prompt_len": a.prompt_len, "batch": a.batch, "ratio": a.ratio, "steps": a.steps, "rounds": a.rounds,
              "dtype": a.dtype, "equal_tokens_to_the_host_corrected_form": same,
              "forms": {f: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for f, rs in runs.items()}}
    for f, share in same.items():
        print(f"tokens of {f} equal to the host-corrected form's: {100 * share:.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
