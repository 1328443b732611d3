"""Skewing (paper section 4.2): an orthogonal matrix per layer and KV head that concentrates the
magnitude of queries and keys in a few columns, so a few columns predict the attention scores.

A calibration pass runs the dense model over real text and accumulates, per layer and KV head, the
Gram matrix C = X^T X of the queries attention actually uses (post-RoPE for the Llama family; the
projection incl. bias for OPT; a constant scale does not change the basis). X stacks the queries of
every query head of the group, `[tokens * G, d]`. The right singular vectors of X are the
eigenvectors of C, so `A = V` (columns ordered by singular value) is the skewing matrix. Because A
is orthogonal, `(qA)(kA)^T = qk^T`: skewing changes no score, only where the magnitude sits.

Without RoPE (OPT) A can be folded into W_Q, W_K and their biases (`skew_model`); with RoPE it is
applied after the rotary embedding at run time (the InfiniGen policy does that for both).
Artifacts are safetensors files in `cache_dir()/skew`, keyed by a model fingerprint and the
calibration text, so a second run reuses them.

The same pass records each layer's attention sparsity (`policies.budgets.attention_sparsity`: the
share of the entries that holds 90% of the attention mass, averaged over query heads and a sample of
rows); InfiniGen spends its all-layer KV budget by it (`policies.budgets.layer_caps`). Artifacts
written before it was recorded load with `sparsity` None (uniform budgets).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import runtime
from .errors import UserError
from .placement import Placement

DEFAULT_CALIB = "emma"  # evaluation defaults to Pride and Prejudice; calibrate on another novel
DEFAULT_TOKENS = 4096
FORMAT_VERSION = "2"  # 2: per-layer attention sparsity
SPARSITY_MASS = 0.9  # a layer's sparsity: the share of its entries holding this much attention mass
SPARSITY_ROWS = 128  # rows per calibration window whose attention is measured (the later 3/4 of it)


# ---- text ------------------------------------------------------------------------------------------
def resolve_text(spec: str | os.PathLike | None) -> Path:
    """The calibration text: a path or a corpus name (see `infinigen.paths`); None: DEFAULT_CALIB."""
    from .paths import resolve_text as resolve
    return resolve(spec, default=DEFAULT_CALIB)


def read_calibration_text(path: Path) -> str:
    """The text of a calibration file: UTF-8 text, or a UserError naming the file (a binary file would
    calibrate on whatever its bytes decode to, and save an artifact as if it were text)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"calibration text {path} is not UTF-8 text (byte {e.start} is not): give a text file")
    if "\0" in text:
        raise UserError(f"calibration text {path} holds NUL bytes, so it is binary, not text: give a text file")
    if not text.strip():
        raise UserError(f"calibration text {path} is empty")
    return text


def calibration_text(spec: str | os.PathLike | None) -> Path:
    """The calibration file of `spec` (see `resolve_text`), checked to be text: before a model loads."""
    path = resolve_text(spec)
    read_calibration_text(path)
    return path


def min_calibration_tokens(cfg) -> int:
    """Tokens the calibration needs at least: a KV head's [d, d] Gram matrix has d meaningful directions
    only from d query rows or more (and a layer's sparsity is measured from 8 rows on)."""
    return max(cfg.head_dim, 8)


def read_tokens(tokenizer, path: Path, n: int, offset: int = 0) -> list[int]:
    """Token ids `offset .. offset+n` of a text file (tokenizes only the prefix it needs); fewer when the
    text is shorter."""
    text = read_calibration_text(path)
    chars = 12 * (n + offset) + 1000  # ~4 chars per token in English; grow if that was not enough
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) >= n + offset + 1 or chars >= len(text):
            break
        chars *= 2
    ids = ids[offset:offset + n]
    if not ids:
        raise UserError(f"{path} holds no text to calibrate on")
    return ids


# ---- progress --------------------------------------------------------------------------------------
class Progress:
    """Progress of a calibration step: `done` of `total` units with an ETA, as a tqdm bar on stderr (`progress`
    True) or given to a callback `progress(desc, done, total, eta_seconds)` (a server's log; eta None until one
    unit is done), or nowhere (`progress` False/None)."""

    def __init__(self, progress, desc: str, total: int, unit: str):
        import time
        self.desc, self.total, self.done, self.clock = desc, total, 0, time.monotonic
        self.start = self.clock()
        self.report = progress if callable(progress) else None
        self.bar = None
        if progress is True:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
        self._report()

    def _report(self) -> None:
        if self.report is not None:
            elapsed = self.clock() - self.start
            eta = elapsed / self.done * (self.total - self.done) if self.done else None
            self.report(self.desc, self.done, self.total, eta)

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self.bar is not None:
            self.bar.update(n)
        self._report()

    def write(self, message: str) -> None:
        """A line on stderr that does not break the bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def finish(self) -> None:
        """Done, perhaps with fewer units than the total foresaw (a search that stopped early)."""
        if self.done < self.total:
            self.total = self.done
            if self.bar is not None:
                self.bar.total = self.done
                self.bar.refresh()
            self._report()
        if self.bar is not None:
            self.bar.close()


# ---- fingerprint -----------------------------------------------------------------------------------
def model_fingerprint(model) -> str:
    """The config plus where the weights came from: the model file's fingerprint when `loading.load` read
    it (`source_fingerprint`: the same in every dtype and weight mode, so one calibration serves them all),
    else a hash of a few attention weights (an in-memory model)."""
    if getattr(model, "skew_folded", None) is not None:
        raise ValueError("fingerprint of a skew-folded model: use the original model")
    cfg = model.cfg
    h = hashlib.sha256(json.dumps([cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                                   cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size]).encode())
    source = getattr(model, "source_fingerprint", None)
    if source is not None:
        h.update(f"file:{source}".encode())
        return h.hexdigest()[:16]
    for layer in (0, cfg.num_layers - 1):
        attn = model.layers[layer].attn
        for w in (attn.q_proj.weight, attn.k_proj.weight):
            h.update(w.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


SIGNATURE_TOL = 0.05  # relative: int4 re-quantization moves these norms by well under 1%



def key_fingerprint(model) -> str:
    """`model_fingerprint`, or for a skew-folded model (whose weights no longer show it) its skew's: what the
    settings derived from a model (InfiniGen's calibration, the measured crossing) are keyed by."""
    try:
        return model_fingerprint(model)
    except ValueError:
        return str(getattr(getattr(model, "skew_folded", None), "meta", {}).get("fingerprint"))

def weight_signature(model) -> list[float]:
    """The norm of each layer's query and key projection weights: within SIGNATURE_TOL of each other in every
    dtype and weight mode of one model file, so an artifact is not taken for a model whose weights were
    changed after loading (`model_fingerprint` names the file only)."""
    out = []
    for blk in model.layers:
        for w in (blk.attn.q_proj.weight, blk.attn.k_proj.weight):
            out.append(round(float(w.detach().float().norm()), 6))
    return out


def signature_matches(meta: dict, model) -> bool:
    """Whether an artifact's recorded `weight_signature` is this model's (one recorded before it was: yes)."""
    if "weight_norms" not in meta:
        return True
    try:
        theirs = [float(x) for x in json.loads(meta["weight_norms"])]
    except (ValueError, TypeError):
        return False
    ours = weight_signature(model)
    return len(theirs) == len(ours) and all(abs(a - b) <= SIGNATURE_TOL * max(abs(a), abs(b), 1e-12)
                                            for a, b in zip(theirs, ours))


# ---- calibration -----------------------------------------------------------------------------------
class _QueryGram(runtime.Listener):
    """Listens to dense prefills; accumulates X^T X of each layer's queries per KV head (float64) and the
    attention sparsity of a sample of rows."""

    def __init__(self, num_layers: int, kv_heads: int, d: int):
        self.gram = torch.zeros(num_layers, kv_heads, d, d, dtype=torch.float64)
        self.tokens = 0
        self.sparsity_sum = torch.zeros(num_layers, dtype=torch.float64)
        self.sparsity_n = torch.zeros(num_layers, dtype=torch.float64)

    def on_prefill(self, layer, q, k, v, session):
        b, h, t, d = q.shape
        hkv = self.gram.shape[1]
        x = q.detach().to(torch.float64).cpu().view(b, hkv, h // hkv, t, d).transpose(0, 1).reshape(hkv, -1, d)
        self.gram[layer] += x.transpose(1, 2) @ x
        if layer == 0:
            self.tokens += b * t
        sp = attention_rows_sparsity(q, k, session.model.scale, session.model.cfg.sliding_window)
        if sp is not None:
            self.sparsity_sum[layer] += sp.double().sum().cpu()
            self.sparsity_n[layer] += sp.numel()

    def sparsity(self) -> torch.Tensor | None:
        """Mean share of the entries holding 90% of the attention, per layer (None: no row measured)."""
        if not bool((self.sparsity_n > 0).all()):
            return None
        return (self.sparsity_sum / self.sparsity_n).float()


def attention_rows_sparsity(q, k, scale: float, window: int | None = None, rows: int = SPARSITY_ROWS):
    """Sparsity (`policies.budgets.attention_sparsity`) of the causal attention of up to `rows` rows of
    the later 3/4 of a prompt (the first rows see too few entries to say anything), per (batch, query
    head, row): q [B, H, T, d], k [B, Hkv, T, d]. None for prompts under 8 tokens."""
    from .sparsity import attention_sparsity
    b, h, t, d = q.shape
    if t < 8:
        return None
    hkv = k.shape[1]
    r = torch.linspace(t // 4, t - 1, min(rows, t - t // 4), device=q.device).round().long().unique()
    qg = q[:, :, r].float().view(b, hkv, h // hkv, len(r), d)
    s = (qg @ k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, R, T]
    cols = torch.arange(t, device=q.device)
    past = cols[None, :] <= r[:, None]
    if window is not None:
        past &= r[:, None] - cols[None, :] < window
    p = torch.softmax(s.masked_fill(~past, float("-inf")), dim=-1)
    return attention_sparsity(p, SPARSITY_MASS)


def query_gram(model, token_ids, window: int = 2048, progress=None, with_sparsity: bool = False):
    """Gram matrices [L, Hkv, d, d] of the queries over `token_ids` (1-D), in windows of `window` tokens,
    and the token count (and, `with_sparsity`, the per-layer attention sparsity or None)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    cfg = model.cfg
    window = max(1, min(window, cfg.max_position))
    gram = _QueryGram(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    chunks = [ids[s:s + window] for s in range(0, len(ids), window)]
    for c in chunks:
        sess = Placement().new_session(model, 1, len(c), listeners=[gram])
        runtime.prefill(model, c[None].to(model.device), sess)
        if progress:
            progress(len(c))
    if with_sparsity:
        return gram.gram, gram.tokens, gram.sparsity()
    return gram.gram, gram.tokens


def skew_from_gram(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A = V of the stacked queries (eigenvectors of X^T X, largest first) and the singular values^2."""
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    return evecs.flip(-1).float().contiguous(), evals.flip(-1).clamp(min=0).float().contiguous()


def column_share(gram: torch.Tensor, matrices: torch.Tensor | None, ratio: float = 0.3) -> torch.Tensor:
    """Share of the queries' squared norm in their top ceil(ratio*d) columns, per layer (mean over KV heads).
    `matrices` None: unskewed columns."""
    g = gram if matrices is None else matrices.double().transpose(-1, -2) @ gram @ matrices.double()
    energy = torch.diagonal(g, dim1=-2, dim2=-1)  # squared norm per column [L, Hkv, d]
    k = math.ceil(ratio * energy.shape[-1])
    top = energy.sort(-1, descending=True).values[..., :k].sum(-1)
    return (top / energy.sum(-1).clamp(min=1e-30)).mean(-1).float()


@dataclass
class Skew:
    """Skewing matrices [L, Hkv, d, d] (q~ = q @ A[layer, kv head]) and where they came from."""
    matrices: torch.Tensor
    sigma2: torch.Tensor  # [L, Hkv, d] squared singular values of the calibration queries
    energy: torch.Tensor  # [L, Hkv, d] squared norm per unskewed column of the calibration queries
    meta: dict = field(default_factory=dict)
    path: Path | None = None
    sparsity: torch.Tensor | None = None  # [L] share of the entries holding 90% of the attention (None: not recorded)
    shipped: bool = False  # read from the package's data/calibration (never written there)

    def share(self, ratio: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
        """(skewed, unskewed) share of the calibration queries' squared norm in the top `ratio` columns."""
        k = math.ceil(ratio * self.energy.shape[-1])
        def top(e):
            return (e.sort(-1, descending=True).values[..., :k].sum(-1) / e.sum(-1).clamp(min=1e-30)).mean(-1)
        return top(self.sigma2), top(self.energy)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        tensors = {"matrices": self.matrices.contiguous(), "sigma2": self.sigma2.contiguous(),
                   "energy": self.energy.contiguous()}
        if self.sparsity is not None:
            tensors["sparsity"] = self.sparsity.float().contiguous()
        try:
            save_file(tensors, str(tmp), metadata={k: str(v) for k, v in self.meta.items()})
            os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
        except BaseException:  # a full disk or Ctrl-C: no partial file stays behind
            tmp.unlink(missing_ok=True)
            raise
        self.path = path

    @classmethod
    def load(cls, path: Path, shipped: bool = False) -> "Skew":
        """The artifact at `path`, checked: readable, shapes that agree, finite values, orthogonal matrices
        (a UserError naming the file otherwise: a broken artifact would skew every score silently)."""
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = dict(f.metadata() or {})
                t = {k: f.get_tensor(k) for k in ("matrices", "sigma2", "energy")}
                sparsity = f.get_tensor("sparsity") if "sparsity" in f.keys() else None  # format 1: none
        except Exception as e:  # corrupt or truncated file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"corrupt skew artifact {path} ({first}); recompute it with `infinigen skew --force`")
        problem = _artifact_problem(t["matrices"], t["sigma2"], t["energy"], sparsity)
        if problem:
            raise UserError(f"corrupt skew artifact {path} ({problem}); recompute it with `infinigen skew --force`")
        return cls(t["matrices"], t["sigma2"], t["energy"], meta, path, sparsity, shipped)


ORTHOGONAL_TOL = 1e-3  # |A^T A - I|: float32 storage of a float64 eigenbasis is ~1e-6 off


def _artifact_problem(matrices, sigma2, energy, sparsity) -> str | None:
    """What is wrong with an artifact's tensors, or None."""
    m = matrices
    if m.dim() != 4 or m.shape[-1] != m.shape[-2] or 0 in m.shape:
        return f"matrices of shape {tuple(m.shape)}, not [layers, KV heads, d, d]"
    for name, x in (("sigma2", sigma2), ("energy", energy)):
        if tuple(x.shape) != tuple(m.shape[:3]):
            return f"{name} of shape {tuple(x.shape)} for matrices of shape {tuple(m.shape)}"
    if sparsity is not None and tuple(sparsity.shape) != (m.shape[0],):
        return f"sparsity of shape {tuple(sparsity.shape)}"
    for name, x in (("matrices", m), ("sigma2", sigma2), ("energy", energy), ("sparsity", sparsity)):
        if x is not None and not bool(torch.isfinite(x).all()):
            return f"{name} hold NaN or infinite values"
    a = m.double()
    err = float((a.transpose(-1, -2) @ a - torch.eye(a.shape[-1], dtype=a.dtype)).abs().amax())
    if err > ORTHOGONAL_TOL:
        return f"matrices are not orthogonal: |A^T A - I| reaches {err:.3g}"
    return None


def compute_skew(model, token_ids, window: int = 2048, progress=None, **meta) -> Skew:
    """Calibrate on `token_ids` (1-D) and return the skew (not saved)."""
    gram, n, sparsity = query_gram(model, token_ids, window, progress, with_sparsity=True)
    mats, sigma2 = skew_from_gram(gram)
    energy = torch.diagonal(gram, dim1=-2, dim2=-1).float().contiguous()
    cfg = model.cfg
    info = {"format": FORMAT_VERSION, "fingerprint": model_fingerprint(model), "arch": cfg.arch,
            "num_layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "tokens": n, "dtype": str(model.dtype).removeprefix("torch."),
            "weights": getattr(getattr(model, "weights_info", None), "mode", "dense"),
            "weight_norms": json.dumps(weight_signature(model))}
    info.update(meta)
    return Skew(mats, sigma2, energy, info, sparsity=sparsity)


def skew_path(model, calib: Path, tokens: int) -> Path:
    from .paths import cache_dir
    text_hash = hashlib.sha256(calib.read_bytes()).hexdigest()[:10]
    return cache_dir() / "skew" / f"{model_fingerprint(model)}-{calib.stem}-{text_hash}-{tokens}.safetensors"


def load_or_compute_skew(model, tokenizer, calib: str | os.PathLike | None = None, tokens: int | None = None,
                         force: bool = False, progress=False) -> Skew:
    """The skew of `model` calibrated on the first `tokens` tokens of `calib` (path or corpus name; None:
    DEFAULT_TOKENS, or all the text holds when it is shorter): read from the cache when it was computed
    before (and `force` is off) or shipped with the package, else computed and saved (`progress`: see
    `Progress`). The text must be UTF-8 and hold at least
    `min_calibration_tokens` tokens (and `tokens`, when given), so an artifact's name says what it holds."""
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise UserError(f"tokens must be a whole number >= 1, got {tokens!r}")
    minimum = min_calibration_tokens(model.cfg)
    if tokens is not None and tokens < minimum:
        raise UserError(f"calibrating this model takes at least {minimum} tokens (head_dim {model.cfg.head_dim}), "
                        f"got tokens={tokens}")
    path_text = resolve_text(calib)
    ids = read_tokens(tokenizer, path_text, tokens or DEFAULT_TOKENS)
    if len(ids) < (tokens or minimum):
        asked = f"the {tokens} asked for" if tokens else f"the {minimum} the calibration needs (head_dim {model.cfg.head_dim})"
        raise UserError(f"calibration text {path_text} holds {len(ids)} tokens, fewer than {asked}; give a longer text")
    path = skew_path(model, path_text, len(ids))
    here = path if path.exists() else shipped_calibration_dir() / path.name
    if here.exists() and not force:
        skew = Skew.load(here, shipped=here != path)
        # an artifact of format 1 has no layer sparsity: recompute it (the matrices come out the same)
        if skew.sparsity is not None and skew.meta.get("fingerprint") == model_fingerprint(model) and signature_matches(
                skew.meta, model) and skew.matrices.shape == (
                model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim, model.cfg.head_dim):
            skew.meta["reused"] = "1"
            return skew
    from .paths import writable_cache
    writable_cache("skew")  # fail now, not after the calibration
    bar = Progress(progress, "calibrating skew", len(ids), "tok")
    skew = compute_skew(model, ids, progress=bar.update,
                        calibration=str(path_text), calibration_sha=path.stem.split("-")[-2])
    bar.finish()
    skew.save(path)
    skew.computed_now = True  # computed on request (`force`): nothing shipped stands in for it
    return skew


def remember(skew: Skew, name: str, value: str) -> None:
    """Keep `value` under `name` in the skew's metadata, and in its artifact when it has one (rewritten
    atomically): what was derived from the skew on this model (InfiniGen's calibrated settings) is then
    reused with it. An artifact that cannot be written keeps the value in memory only."""
    skew.meta[name] = value
    if skew.path is not None:
        reused = skew.meta.pop("reused", None)  # a fact of this load, not of the artifact
        try:
            if skew.shipped:  # the package's copy stays as shipped: the cache gets one with the new value
                from .paths import cache_dir
                skew.shipped = False
                skew.save(cache_dir() / "skew" / skew.path.name)
            else:
                skew.save(skew.path)
        except OSError:
            pass
        if reused is not None:
            skew.meta["reused"] = reused


def shipped_calibration_dir() -> Path:
    """The package's calibrations (data/calibration): artifacts named like the cache's, so found by the
    fingerprint of the model they were made on, and never applied to another."""
    from .paths import PACKAGE_DATA
    return PACKAGE_DATA / "calibration"


def shipped_holding(model, name: str) -> Skew | None:
    """The package's artifact for `model` whose metadata holds `name` (a calibrated choice), or None."""
    try:
        fp = model_fingerprint(model)
    except ValueError:
        return None
    folder = shipped_calibration_dir()
    for p in sorted(folder.glob(f"{fp}-*.safetensors")) if folder.is_dir() else ():
        try:
            skew = Skew.load(p, shipped=True)
        except UserError:
            continue
        if skew.meta.get("fingerprint") == fp and signature_matches(skew.meta, model) and name in skew.meta:
            return skew
    return None


def find_cached_skew(model) -> Skew | None:
    """A skew artifact of this model in the cache, else one the package ships for it (the default
    calibration preferred in each), or None."""
    from .paths import cache_dir
    fp = model_fingerprint(model)
    corrupt = None
    for folder, shipped in ((cache_dir() / "skew", False), (shipped_calibration_dir(), True)):
        if not folder.is_dir():
            continue
        found = sorted(folder.glob(f"{fp}-*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True)
        preferred = [p for p in found
                     if p.name.startswith(f"{fp}-{DEFAULT_CALIB}-") and p.stem.endswith(f"-{DEFAULT_TOKENS}")]
        for p in preferred + found:
            try:
                skew = Skew.load(p, shipped=shipped)
            except UserError as e:
                corrupt = corrupt or e
                continue
            # a file renamed to another model's name, or a model changed after loading: not this model's
            if skew.meta.get("fingerprint") == fp and signature_matches(skew.meta, model):
                return skew
    if corrupt is not None:  # only unreadable artifacts: say which file, and how to replace it
        raise corrupt
    return None


# ---- folding into the weights (models without RoPE) ----------------------------------------------
def skew_model(model, skew: Skew):
    """A copy of an OPT-style (no RoPE) model with A folded into W_Q, W_K and their biases per head:
    the copy computes q~ = qA and k~ = kA directly, its dense logits equal the original's.
    The copy carries `skew_folded` so the InfiniGen policy does not rotate a second time."""
    cfg = model.cfg
    if cfg.uses_rope:
        raise ValueError("skewing cannot be folded into the weights of a RoPE model; it is applied after RoPE at run time")
    out = copy.deepcopy(model)
    d, g = cfg.head_dim, cfg.group_size
    with torch.no_grad():
        for i, blk in enumerate(out.layers):
            a = skew.matrices[i].to(torch.float64)  # [Hkv, d, d]
            for proj, heads in ((blk.attn.q_proj, cfg.num_heads), (blk.attn.k_proj, cfg.num_kv_heads)):
                per = a if heads == cfg.num_kv_heads else a.repeat_interleave(g, 0)  # query head h uses A[h // G]
                w = proj.weight.to(torch.float64).view(heads, d, -1)
                proj.weight.copy_((per.transpose(1, 2) @ w).reshape_as(proj.weight))  # rows: A^T W_h
                if proj.bias is not None:
                    b = proj.bias.to(torch.float64).view(heads, 1, d)
                    proj.bias.copy_((b @ per).reshape_as(proj.bias))
    out.skew_folded = skew
    return out
