"""The paper's analyses on any supported model, each as numbers (a markdown table) and a PNG.

  table1    cosine similarity of layer i's block input with layer i-1's block input, attention output
            and FFN output (paper Table 1), per layer and on average, over every token of the text.
  fig3      attention weights under H2O and the oracle ("Optimal") with the same token budget vs the
            full cache, per layer (paper Figure 3); InfiniGen's own (dynamic) selection alongside.
            For each decoding row and query head: cos(p_full, p_sel), where p_full is the softmax over
            every cached token and p_sel the softmax over what the policy read, both for the query the
            policy's run produced (the row-wise comparison the paper's footnote describes).
  fig5      histogram of the number of keys needed to reach 0.9 of a query's attention weight, per layer
            (paper Figure 5; bin width 16), full cache, every query row and head of the text.
  alpha     the number of tokens whose true attention score lies within alpha of the row's maximum,
            against the sequence length (what InfiniGen's threshold selects with an exact speculation).
  fig17     InfiniGen sensitivity: perplexity and relative KV size across alpha and partial weight ratio
            (paper Figure 17; the paper's accuracy axis is WinoGrande, ours is perplexity on the text).
  fig13     skewing on and off: perplexity and relative KV size with the dynamic (alpha) budget and with
            a fixed 20% budget (paper Figure 13 uses the fixed budget and lm-eval accuracy).
  recall    InfiniGen's selection against the true top entries of the same size, per selecting layer and
            KV head, in fast memory (the query `query` resolves to there: "own" in the default preset) and
            offloaded uncorrected (`kv_offload="cpu"`, `correct=False`: speculated one layer ahead unless
            `query="own"`; corrected, it selects what fast memory selects): the share of
            the selected entries among the top ones (recall), the attention mass each set covers, and each
            form's perplexity beside the full cache's; also written as recall.json.

All runs use our runtime: prefill or teacher-forced passes over one window of the text; the policies
come from the registry (`make_policy`), InfiniGen with the paper's settings unless knobs say otherwise.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import runtime
from ..errors import UserError
from ..placement import Placement
from ..selection import ALL
from .recall import COVERED, FORMS, RECALL_FLOOR, selection_recall

ANALYSES = ("table1", "fig3", "fig5", "alpha", "fig17", "fig13", "recall")
ROWS = 256  # query rows per chunk in the prefill statistics


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ---- table 1: block input similarity --------------------------------------------------------------
@torch.inference_mode()
def block_similarity(model, ids: torch.Tensor) -> list[dict]:
    """Per layer i >= 1: mean cosine similarity (over tokens) of Tblock_in_i with Tblock_in_{i-1},
    Attn_out_{i-1} and FFN_out_{i-1}. ids [1, T]."""
    blocks_in, attn_out, ffn_out, hooks = {}, {}, {}, []
    for i, blk in enumerate(model.layers):
        if model.cfg.pre_norm:  # the block input is what the attention norm reads
            hooks.append(blk.attn_norm.register_forward_pre_hook(lambda m, a, i=i: blocks_in.__setitem__(i, a[0][0])))
        else:  # post-norm: the projections read the block input directly
            hooks.append(blk.attn.q_proj.register_forward_pre_hook(lambda m, a, i=i: blocks_in.__setitem__(i, a[0][0])))
        hooks.append(blk.attn.o_proj.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o[0])))
        hooks.append(blk.mlp.register_forward_hook(lambda m, a, o, i=i: ffn_out.__setitem__(i, o[0])))
    try:
        runtime.prefill(model, ids, Placement().new_session(model, 1, ids.shape[1]))
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i in range(1, model.cfg.num_layers):
        cur = blocks_in[i].float()
        out.append({"layer": i, **{name: F.cosine_similarity(cur, src[i - 1].float(), dim=-1).mean().item()
                                   for name, src in (("tblock_in", blocks_in), ("attn_out", attn_out),
                                                     ("ffn_out", ffn_out))}})
    return out


# ---- fig 5 and the alpha count: statistics of the full-cache prompt attention ------------------------
class _PromptStats(runtime.Listener):
    """Records, in `on_prefill`, per layer: keys needed for `mass` of each row's attention, and tokens
    within alpha of each row's maximum score (every query head; rows are sequence positions)."""

    def __init__(self, alphas, mass: float = 0.9):
        self.alphas, self.mass = list(alphas), mass
        self.keys_for_mass, self.above = {}, {}

    def on_prefill(self, layer, q, k, v, session):
        b, h, t, d = q.shape
        hkv = k.shape[1]
        qg = q[0].view(hkv, h // hkv, t, d).float()
        kk = k[0].float()
        need = torch.empty(h, t, dtype=torch.int32)
        above = torch.empty(len(self.alphas), h, t, dtype=torch.int32)
        cols = torch.arange(t)
        for s in range(0, t, ROWS):
            e = min(t, s + ROWS)
            scores = torch.matmul(qg[:, :, s:e], kk[:, None].transpose(-1, -2)) * session.model.scale  # [Hkv,G,R,T]
            causal = cols[None, :] <= torch.arange(s, e)[:, None]
            scores = scores.masked_fill(~causal, float("-inf")).reshape(h, e - s, t)
            probs = scores.softmax(-1)
            cum = probs.sort(-1, descending=True).values.cumsum(-1)
            need[:, s:e] = ((cum < self.mass).sum(-1) + 1).clamp(max=torch.arange(s, e)[None] + 1).int()
            top = scores.amax(-1, keepdim=True)
            for a, alpha in enumerate(self.alphas):
                above[a, :, s:e] = (scores > top - alpha).sum(-1).int()
        self.keys_for_mass[layer] = need
        self.above[layer] = above


@torch.inference_mode()
def prompt_statistics(model, ids: torch.Tensor, alphas=(3, 5, 7), mass: float = 0.9) -> _PromptStats:
    probe = _PromptStats(alphas, mass)
    runtime.prefill(model, ids, Placement().new_session(model, 1, ids.shape[1], listeners=[probe]))
    return probe


# ---- fig 3: attention similarity against the full cache ---------------------------------------------
class AttentionProbe(runtime.Listener):
    """Records, for every decoding row and layer, the cosine similarity between the attention weights
    over what the session's policy read and over every cached token (same query)."""
    per_row = True  # each row against the store as decoding holds it: teacher-forced scoring replays

    def __init__(self, num_layers: int):
        self.cos = [[] for _ in range(num_layers)]
        self._pending = {}

    def on_select(self, layer, rows, keep, session):
        valid = session.store.past(layer)[2].clone()
        self._pending[layer] = (rows.query, valid, ALL if keep is ALL else keep[:, :, 0] & valid)

    def on_append(self, layer, slots, k, v, session):
        q, valid, keep = self._pending.pop(layer)
        n = valid.shape[-1]
        kp = session.store.past(layer)[0][:, :, :n].float()
        b, h, _, d = q.shape
        hkv = kp.shape[1]
        qg = q.view(b, hkv, h // hkv, d).float()
        scale = session.model.scale
        s = torch.matmul(qg, kp.transpose(-1, -2)) * scale  # [B, Hkv, G, n]
        cur = (qg * k[:, :, 0, None].float()).sum(-1, keepdim=True) * scale
        full = torch.cat([s.masked_fill(~valid[:, :, None], float("-inf")), cur], -1).softmax(-1)
        if keep is ALL:
            sim = torch.ones(())
        else:
            sel = torch.cat([s.masked_fill(~keep[:, :, None], float("-inf")), cur], -1).softmax(-1)
            sim = F.cosine_similarity(full, sel, dim=-1).mean()
        self.cos[layer].append(float(sim))


@torch.inference_mode()
def attention_similarity(model, ids: torch.Tensor, policies: dict, prefill: int, progress=None) -> dict:
    """name -> cos [num_layers, rows]: per decoding row (positions prefill..T-1) and layer."""
    out = {}
    for name, pol in policies.items():
        probe = AttentionProbe(model.cfg.num_layers)
        sess = Placement().new_session(model, 1, ids.shape[1], pol, listeners=[probe])
        runtime.teacher_forced(model, ids, prefill, sess)
        out[name] = torch.tensor(probe.cos)
        if progress:
            progress(1)
    return out


# ---- fig 17 and fig 13: perplexity sweeps ----------------------------------------------------------
@dataclass
class SweepPoint:
    sweep: str
    value: object
    ppl: float
    kv: float  # relative KV size over all layers
    kv_speculated: float  # over the layers the policy speculates
    knobs: dict = field(default_factory=dict)


def _ppl(model, tok, ids, policy, prefill):
    from .ppl import perplexity
    return perplexity(model, tok, None, policy, prefill=prefill, tokens=ids)


def _infinigen(knobs: dict, matrices=None):
    """InfiniGen with these knobs, and these skew matrices when given (else `prepare` finds them)."""
    from ..policies import make_policy
    pol = make_policy("infinigen", **knobs)
    return pol if matrices is None else pol.with_skew(matrices)


def sweep(model, tok, ids, prefill: int, base: dict, name: str, values, knob: str, progress=None,
          matrices=None) -> list[SweepPoint]:
    out = []
    for v in values:
        knobs = {**base, knob: v}
        r = _ppl(model, tok, ids, _infinigen(knobs, matrices), prefill)
        out.append(SweepPoint(name, v, r.perplexity, r.kv_all, r.kv_speculated, knobs))
        if progress:
            progress(1)
    return out


# ---- the whole report -------------------------------------------------------------------------------
@dataclass
class Settings:
    tokens: int = 1024  # window of the text
    prefill: int = 128  # dense prompt of the teacher-forced runs (fig3, fig17, fig13)
    budget: float = 0.1  # fig3: token budget of H2O and the oracle, as a fraction of the window
    alphas: tuple = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # fig17
    ratios: tuple = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # fig17
    count_alphas: tuple = (3, 5, 7)  # tokens above max - alpha
    knobs: dict = field(default_factory=lambda: {"preset": "paper"})  # InfiniGen knobs
    matrices: object = None  # InfiniGen's skew matrices (None: the model's, from `Policy.prepare`)


def _table(header: list[str], rows: list[list]) -> str:
    def fmt(x):
        return f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _shortfall(layers: dict) -> list[str]:
    """The summary's per-layer cells: the lowest layer's recall, and the layers under the floor."""
    low = layers["lowest"]
    under = ", ".join(map(str, layers["under"])) or "none"
    return ["-" if low is None else f"{low['recall']:.3f} (layer {low['layer']})",
            f"{len(layers['under'])} of {len(layers['layers'])}: {under}"]


def _recall_report(rec: dict, prefill: int, tokens: int) -> list[str]:
    forms = [f for f in FORMS if f in rec]
    full = rec["full"]["perplexity"]
    summary = [[f, rec[f]["query"], rec[f]["kv"], rec[f]["perplexity"],
                f"{100 * (rec[f]['perplexity'] / full - 1):+.2f}%"]
               + [rec[f]["mean"][k] for k in ("read_share", "recall", "mass_read", "mass_top")]
               + _shortfall(rec[f]["by_layer"]) for f in forms]
    by_key = {f: {(r["layer"], r["kv_head"]): r for r in rec[f]["layers"]} for f in forms}
    keys = sorted(set().union(*[set(by_key[f]) for f in forms]))
    cell = lambda f, key, k: by_key[f][key][k] if key in by_key[f] else "-"  # noqa: E731
    rows = [[layer, head] + [cell(f, (layer, head), k) for f in forms
                             for k in ("read_share", "recall", "mass_read", "mass_top")] for layer, head in keys]
    return [f"## Recall: the selection against the true top entries of the same size (decoding rows {prefill}.."
            f"{tokens - 1})", "",
            "Per KV head, an entry's true attention is its query heads' mean softmax probability (the layer's own "
            "query); \"top\" is the same number of entries with the most of it. recall: the share of the read "
            "entries among the top ones; mass: the attention each set covers (mean over rows). Full-cache "
            f"perplexity {full:.3f}.", "",
            _table(["form", "query", "KV read (all layers)", "perplexity", "vs full", "read share (selecting layers)",
                    "recall", "mass read", "mass of top", "lowest layer: recall",
                    f"layers under {RECALL_FLOOR}"], summary), "",
            f"Per layer: its KV heads' rows pooled; a layer where the read and the top set both cover more than "
            f"{COVERED:.0%} of the past's attention is not counted under {RECALL_FLOOR}.", "",
            "<details><summary>per layer and KV head</summary>", "",
            _table(["layer", "KV head"] + [f"{f}: {k}" for f in forms for k in ("read", "recall", "mass", "top mass")],
                   rows), "", "</details>", ""]


@dataclass
class _Job:
    """One `run`: what every analysis reads, and the folder its figures go to."""
    model: object
    tok: object
    ids: torch.Tensor
    out: Path
    st: Settings
    plt: object
    tick: object

    @property
    def L(self) -> int:
        return self.model.cfg.num_layers

    @property
    def T(self) -> int:
        return self.ids.shape[1]


def run(model, tok, ids: torch.Tensor, out: Path, which=ANALYSES, settings: Settings | None = None,
        model_name: str = "", text_name: str = "", progress=None) -> str:
    """Run the analyses in `which` on ids [1, T]; write PNGs into `out`; return the markdown report."""
    st = settings or Settings()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    job = _Job(model, tok, ids, out, st, _plt(), progress or (lambda n=1: None))
    ig_knobs = dict(st.knobs)
    md = [f"# Analyses: {model_name}", "",
          f"Text: {text_name}, {job.T} tokens (one window). InfiniGen knobs: "
          f"{ {k: v for k, v in ig_knobs.items() if not isinstance(v, torch.Tensor)} }.", ""]
    if "table1" in which:
        md += _table1(job)
    if "fig5" in which or "alpha" in which:
        stats = prompt_statistics(model, ids, st.count_alphas)
        job.tick(1)
        if "fig5" in which:
            md += _fig5(job, stats)
        if "alpha" in which:
            md += _tokens_above_alpha(job, stats)
    if "fig3" in which:
        md += _fig3(job)
    if "fig17" in which or "fig13" in which:
        full, lines = _full_perplexity(job)
        md += lines
        if "fig17" in which:
            md += _fig17(job, full)
        if "fig13" in which:
            md += _fig13(job, full)
    if "recall" in which:
        md += _recall(job, ig_knobs, model_name, text_name)
    report = "\n".join(md)
    (out / "analyze.md").write_text(report)
    return report


def _recall(job: _Job, ig_knobs: dict, model_name: str, text_name: str) -> list[str]:
    from .policyset import prepare
    pol = prepare({"infinigen": _infinigen(ig_knobs, job.st.matrices)}, job.model, job.tok)["infinigen"]
    rec = selection_recall(job.model, job.ids, pol, job.st.prefill)
    job.tick(1 + len(FORMS))
    (job.out / "recall.json").write_text(json.dumps(
        {"model": model_name, "text": text_name, "tokens": job.T, "prefill": job.st.prefill,
         "settings": pol.settings(job.model), **rec}, indent=1, default=str))
    return _recall_report(rec, job.st.prefill, job.T)


def _table1(job: _Job) -> list[str]:
    """Table 1: how alike consecutive blocks' inputs are."""
    model, ids, out, plt, tick, L = job.model, job.ids, job.out, job.plt, job.tick, job.L
    rows = block_similarity(model, ids)
    tick(1)
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("tblock_in", "attn_out", "ffn_out")}
    fig, ax = plt.subplots(figsize=(7, 3.2), constrained_layout=True)
    for k, label in (("tblock_in", "Tblock_in(i-1)"), ("attn_out", "Attn_out(i-1)"), ("ffn_out", "FFN_out(i-1)")):
        ax.plot([r["layer"] for r in rows], [r[k] for r in rows], marker="o", ms=3, label=label)
    ax.set_xlabel("layer i")
    ax.set_ylabel("cosine similarity with Tblock_in(i)")
    ax.set_ylim(-0.2, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out / "table1_block_similarity.png", dpi=120)
    plt.close(fig)
    return ["## Table 1: similarity of consecutive block inputs", "",
            _table(["tensor", "mean cosine similarity with Tblock_in(i), layers 1.." + str(L - 1)],
                   [["Tblock_in(i-1)", mean["tblock_in"]], ["Attn_out(i-1)", mean["attn_out"]],
                    ["FFN_out(i-1)", mean["ffn_out"]]]), "",
            "<details><summary>per layer</summary>", "",
            _table(["layer", "Tblock_in(i-1)", "Attn_out(i-1)", "FFN_out(i-1)"],
                   [[r["layer"], r["tblock_in"], r["attn_out"], r["ffn_out"]] for r in rows]), "", "</details>", "",
            "![table 1](table1_block_similarity.png)", ""]


def _fig5(job: _Job, stats) -> list[str]:
    """Figure 5: the keys needed to reach 0.9 of the attention weight."""
    out, plt, L, T = job.out, job.plt, job.L, job.T
    cols = min(6, L)
    nrow = math.ceil(L / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(2.1 * cols, 1.6 * nrow), squeeze=False,
                             constrained_layout=True)
    rows = []
    for i in range(L):
        need = stats.keys_for_mass[i].flatten().float()
        ax = axes[i // cols][i % cols]
        ax.hist(need.numpy(), bins=range(0, int(need.max()) + 17, 16), color="tab:blue")
        ax.set_title(f"layer {i}", fontsize=8)
        ax.tick_params(labelsize=6)
        # keys needed over the keys the query row can see (query t sees t + 1)
        share = need / (torch.arange(T).float() + 1).repeat(stats.keys_for_mass[i].shape[0])
        rows.append([i, need.mean().item(), need.median().item(), need.quantile(0.9).item(),
                     share.mean().item()])
    for j in range(L, nrow * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("keys needed for 0.9 of the attention weight (x: keys, bins of 16; y: query rows x heads)",
                 fontsize=9)
    fig.savefig(out / "fig5_keys_for_90pct.png", dpi=120)
    plt.close(fig)
    return ["## Figure 5: keys needed to reach 0.9 of the attention weight (full cache)", "",
            _table(["layer", "mean keys", "median", "90th percentile", "mean share of the row's keys"],
                   rows), "",
            "![figure 5](fig5_keys_for_90pct.png)", ""]


def _tokens_above_alpha(job: _Job, stats) -> list[str]:
    """The tokens within alpha of the maximum score, against sequence length."""
    out, plt, st, L, T = job.out, job.plt, job.st, job.L, job.T
    nb = min(16, T)
    edges = torch.linspace(0, T, nb + 1).long()
    fig, ax = plt.subplots(figsize=(6, 3.2), constrained_layout=True)
    table_rows = []
    curves = {}
    for a, alpha in enumerate(st.count_alphas):
        per_pos = torch.stack([stats.above[i][a].float().mean(0) for i in range(L)]).mean(0)  # [T]
        curves[alpha] = [per_pos[edges[j]:edges[j + 1]].mean().item() for j in range(nb)]
        ax.plot(edges[1:].tolist(), curves[alpha], marker="o", ms=3, label=f"alpha {alpha}")
    for j in range(nb):
        table_rows.append([int(edges[j + 1])] + [curves[al][j] for al in st.count_alphas]
                          + [curves[al][j] / max(1.0, (edges[j] + edges[j + 1]).item() / 2)
                             for al in st.count_alphas])
    ax.set_xlabel("sequence length (query position)")
    ax.set_ylabel("tokens with score > max - alpha")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out / "tokens_above_alpha.png", dpi=120)
    plt.close(fig)
    return ["## Tokens within alpha of the maximum score, against sequence length (full cache, true scores)", "",
            "Mean over layers and query heads; the share divides by the bin's mean length.", "",
            _table(["up to length"] + [f"alpha {a}" for a in st.count_alphas]
                   + [f"share, alpha {a}" for a in st.count_alphas], table_rows), "",
            "![tokens above max - alpha](tokens_above_alpha.png)", ""]


def _fig3(job: _Job) -> list[str]:
    """Figure 3: attention weights of H2O, the oracle and InfiniGen against the full cache."""
    from ..policies import make_policy
    model, tok, ids, out, plt, st, tick = job.model, job.tok, job.ids, job.out, job.plt, job.st, job.tick
    L, T = job.L, job.T
    ig_knobs = dict(st.knobs)
    b = max(2, int(round(st.budget * T)))
    pols = {"h2o": make_policy("h2o", heavy=b // 2, recent=b - b // 2), "oracle": make_policy("oracle", tokens=b),
            "infinigen": _infinigen(ig_knobs, st.matrices)}
    from .policyset import prepare
    prepare(pols, model, tok)
    sims = attention_similarity(model, ids, pols, st.prefill, progress=tick)
    positions = torch.arange(st.prefill, T)
    mid = L * 2 // 3
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4), constrained_layout=True)
    for name, c in sims.items():
        axes[0].plot(range(L), c.mean(1).tolist(), marker="o", ms=3, label=name)
        for ax, layer in ((axes[1], 0), (axes[2], mid)):
            w = 16
            smooth = F.avg_pool1d(c[layer][None, None], w, 1).flatten() if c.shape[1] >= w else c[layer]
            ax.plot(positions[: smooth.shape[0]].tolist(), smooth.tolist(), label=name)
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("mean cosine similarity")
    axes[1].set_title("layer 0", fontsize=9)
    axes[2].set_title(f"layer {mid}", fontsize=9)
    for ax in axes[1:]:
        ax.set_xlabel("token position")
        ax.axvline(b, color="grey", ls=":", lw=1)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"attention weights vs the full cache (H2O and oracle: {b} tokens)", fontsize=10)
    fig.savefig(out / "fig3_attention_similarity.png", dpi=120)
    plt.close(fig)
    names = list(sims)
    rows = [[i] + [sims[n][i].mean().item() for n in names] for i in range(L)]
    rows.append(["mean"] + [sims[n].mean().item() for n in names])
    return [f"## Figure 3: attention cosine similarity vs the full cache (budget {b} tokens = {st.budget:.0%} "
            f"of {T}; decoding rows {st.prefill}..{T - 1})", "",
            _table(["layer"] + names, rows), "", "![figure 3](fig3_attention_similarity.png)", ""]


def _full_perplexity(job: _Job):
    """The full cache's perplexity on the window (what figures 13 and 17 compare with) and its line."""
    model, tok, ids, st, tick, T = job.model, job.tok, job.ids, job.st, job.tick, job.T
    ig_knobs = dict(st.knobs)
    from ..policies import make_policy
    from .policyset import prepare
    prepare({"infinigen": _infinigen(ig_knobs, st.matrices)}, model, tok)
    full = _ppl(model, tok, ids, make_policy("full"), st.prefill)
    tick(1)
    return full, [f"Full-cache perplexity on this window (prefill {st.prefill}, {T - st.prefill} decoded tokens): "
                  f"{full.perplexity:.3f}", ""]


def _fig17(job: _Job, full) -> list[str]:
    """Figure 17: InfiniGen's sensitivity to alpha and the partial weight ratio."""
    model, tok, ids, out, plt, st, tick = job.model, job.tok, job.ids, job.out, job.plt, job.st, job.tick
    ig_knobs = dict(st.knobs)
    a_pts = sweep(model, tok, ids, st.prefill, ig_knobs, "alpha", st.alphas, "alpha", tick, st.matrices)
    r_pts = sweep(model, tok, ids, st.prefill, ig_knobs, "partial_ratio", st.ratios, "partial_ratio", tick,
                  st.matrices)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.4), constrained_layout=True)
    for ax, pts, label in ((axes[0], a_pts, "alpha"), (axes[1], r_pts, "partial weight ratio")):
        xs = [p.value for p in pts]
        ax.plot(xs, [p.ppl for p in pts], marker="o", color="tab:blue", label="perplexity")
        ax.axhline(full.perplexity, color="tab:blue", ls=":", lw=1, label="full cache")
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(xs, [p.kv for p in pts], marker="s", color="tab:red", label="relative KV size")
        ax2.set_ylabel("relative KV size", color="tab:red")
        ax2.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    fig.suptitle("InfiniGen sensitivity", fontsize=10)
    fig.savefig(out / "fig17_sensitivity.png", dpi=120)
    plt.close(fig)
    return ["## Figure 17: InfiniGen sensitivity to alpha and the partial weight ratio", "",
            _table(["sweep", "value", "perplexity", "vs full", "relative KV size (all layers)",
                    "(speculated layers)"],
                   [[p.sweep, p.value, p.ppl, f"{100 * (p.ppl / full.perplexity - 1):+.2f}%", p.kv, p.kv_speculated]
                    for p in a_pts + r_pts]), "", "![figure 17](fig17_sensitivity.png)", ""]


def _fig13(job: _Job, full) -> list[str]:
    """Figure 13: skewing on and off, with a dynamic and a fixed budget."""
    model, tok, ids, out, plt, st, tick = job.model, job.tok, job.ids, job.out, job.plt, job.st, job.tick
    ig_knobs = dict(st.knobs)
    rows, bars = [], []
    for budget, extra in (("dynamic (alpha)", {}), ("fixed 20%", {"alpha": 1e9, "max_fetch_ratio": 0.2})):
        for skew in (True, False):
            knobs = {**ig_knobs, **extra, "skew": skew}
            r = _ppl(model, tok, ids, _infinigen(knobs, st.matrices), st.prefill)
            tick(1)
            rows.append([budget, "on" if skew else "off", r.perplexity,
                         f"{100 * (r.perplexity / full.perplexity - 1):+.2f}%", r.kv_all, r.kv_speculated])
            bars.append((f"{budget}\nskew {'on' if skew else 'off'}", r.perplexity))
    fig, ax = plt.subplots(figsize=(6, 3.2), constrained_layout=True)
    ax.bar(range(len(bars)), [b for _, b in bars], color=["tab:green", "tab:gray"] * 2)
    ax.axhline(full.perplexity, color="k", ls=":", lw=1, label="full cache")
    ax.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=7)
    ax.set_ylabel("perplexity")
    lo = min(full.perplexity, min(b for _, b in bars))
    ax.set_ylim(lo * 0.95, max(b for _, b in bars) * 1.02)
    ax.legend(fontsize=8)
    fig.savefig(out / "fig13_skewing.png", dpi=120)
    plt.close(fig)
    return ["## Figure 13: skewing on and off", "",
            _table(["budget", "skewing", "perplexity", "vs full", "relative KV size (all layers)",
                    "(speculated layers)"], rows),
            "", "![figure 13](fig13_skewing.png)", ""]


def steps(which, settings: Settings) -> int:
    """Progress units `run` reports for `which`."""
    n = 0
    n += "table1" in which
    n += "fig5" in which or "alpha" in which
    n += 3 if "fig3" in which else 0
    n += 1 if ("fig17" in which or "fig13" in which) else 0
    n += len(settings.alphas) + len(settings.ratios) if "fig17" in which else 0
    n += 4 if "fig13" in which else 0
    n += 1 + len(FORMS) if "recall" in which else 0
    return n


def parse_which(spec: str) -> tuple:
    if spec in ("", "all"):
        return ANALYSES
    out = tuple(s.strip() for s in spec.split(",") if s.strip())
    for s in out:
        if s not in ANALYSES:
            raise UserError(f"unknown analysis {s!r}; choose from {', '.join(ANALYSES)} or all")
    return out
