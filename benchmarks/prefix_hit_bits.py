"""A prefix-cache hit against a miss on the default model in its defaults (bfloat16, the GGUF's int4 weights): each
prompt prefilled whole (the miss), then for every whole block of 256 tokens a session given that prefix's keys and
values from the whole prefill (the hit, `Session.restore_prefix` a block at a time) prefills the rest; the largest
logit difference and whether 6 greedy tokens agree. `--tile 256`: both prefills in tiles (the server's form with a
prefix cache, `prefill_in_slices(tile=)`); `--tile 0`: untiled. `--cost`: the whole prefill's CPU time (one
thread) untiled and tiled, interleaved.

    PYTHONPATH=src python benchmarks/prefix_hit_bits.py --tile 0 300 515 540 600 1100 2100
    PYTHONPATH=src python benchmarks/prefix_hit_bits.py --tile 256 300 515 540 600 1100 2100
    PYTHONPATH=src python benchmarks/prefix_hit_bits.py --cost 2048 8000
"""
from __future__ import annotations

import argparse
import time

import torch

from infinigen import runtime
from infinigen.loading import load
from infinigen.paths import resolve_text
from infinigen.placement import Placement
from infinigen.policies import make_policy

BLOCK = 256


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lengths", type=int, nargs="+")
    ap.add_argument("--tile", type=int, default=BLOCK)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--cost", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok, _ = load(None, dtype="auto")
    ids_all = tok.encode(open(resolve_text("northangerabbey"), encoding="utf-8").read())
    pol = make_policy(args.policy).prepare(model, tok)
    layers = range(model.cfg.num_layers)

    def session(n):
        return Placement().new_session(model, 1, n + 8, pol)

    def greedy(sess, logits, k=6):
        out = [int(logits.argmax(-1))]
        for _ in range(k - 1):
            out.append(int(runtime.decode(model, torch.tensor([out[-1]]), sess).argmax(-1)))
        return out

    for n in args.lengths:
        ids = torch.tensor([ids_all[:n]])
        if args.cost:
            for r in range(args.rounds):
                for tile in (0, BLOCK):
                    t = time.thread_time()
                    runtime.prefill(model, ids, session(n), tile=tile)
                    print(f"n={n} round={r} tile={tile} cpu={time.thread_time() - t:.2f}s", flush=True)
            continue
        whole = session(n)
        want = runtime.prefill(model, ids, whole, tile=args.tile)
        want_tokens = greedy(whole, want)
        for m in range(1, (n - 1) // BLOCK + 1):
            hit = session(n)
            for i in range(m):
                span = slice(i * BLOCK, (i + 1) * BLOCK)
                hit.restore_prefix([whole.store.past(j)[0][:, :, span].clone() for j in layers],
                                   [whole.store.past(j)[1][:, :, span].clone() for j in layers], at=i * BLOCK)
            got = runtime.prefill(model, ids[:, m * BLOCK:], hit, cached=m * BLOCK, tile=args.tile)
            diff = (want.float() - got.float()).abs().max().item()
            print(f"n={n} blocks={m} rest={n - m * BLOCK} max_logit_diff={diff} "
                  f"tokens_equal={greedy(hit, got) == want_tokens}", flush=True)


if __name__ == "__main__":
    main()
