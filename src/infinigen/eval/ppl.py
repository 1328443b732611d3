"""Perplexity with any KV-cache policy, in teacher-forced mode.

A window of `ctx` tokens is split into a prompt (the first `prefill` tokens, dense attention) and a
decoding part that `Transformer.teacher_forced` evaluates as if decoded one token at a time with the
policy. Scored: the NLL of token t+1 from the logits at t for every t >= prefill - 1, so exactly the
ctx - prefill tokens a decoder would produce (the first from the prompt's last logits). Reported per
256-token decoding chunk too (the paper's Figure 12), with the relative KV size: the fraction of
cached entries each layer's attention read, over all layers and over the speculated layers only.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import runtime
from ..errors import UserError
from ..placement import Placement
from ..policies.calibrate import counted_layers

CHUNK = 256  # tokens per decoding chunk (the paper's Figure 12)
SCORE_ROWS = 512  # logits rows turned into log-probabilities at once: bounds memory at large vocabularies


# ---- text ------------------------------------------------------------------------------------------
from ..paths import corpus_names, data_dirs, load_text, resolve_text  # noqa: E402,F401  (one copy, in paths)


def token_windows(tokenizer, body: str, ctx: int, windows: int = 1) -> torch.Tensor:
    """`windows` non-overlapping windows of `ctx` tokens from the start of the text: [windows, ctx]. A
    tokenizer that starts every input with BOS (Gemma: the model was trained so, and scores ~40% worse
    without it) gets BOS at the start of each window, then ctx - 1 tokens of text."""
    bos = _leading_bos(tokenizer)
    per = ctx - (bos is not None)
    need = per * windows
    ids: list[int] = []
    for chars in (need * 8, None):  # a prefix is enough for most texts; tokenize all when it is not
        ids = tokenizer(body if chars is None else body[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= need or chars is None or chars >= len(body):
            break
    if len(ids) < need:
        raise UserError(f"the text has {len(ids)} tokens; {windows} window(s) of {ctx} need {need}")
    rows = torch.tensor(ids[:need], dtype=torch.long).view(windows, per)
    if bos is not None:
        rows = torch.cat([torch.full((windows, 1), bos, dtype=torch.long), rows], dim=1)
    return rows


def _leading_bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer puts it before every input by default, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        first = tokenizer("a", verbose=False)["input_ids"][:1]
    except Exception:  # a tokenizer that cannot say: score the text as it is
        return None
    return bos if first == [bos] else None


# ---- policy facts ----------------------------------------------------------------------------------
def speculated_layers(policy, num_layers: int) -> list[int]:
    """Layers where the policy selects entries (the others it reads in full)."""
    return [i for i in range(num_layers) if policy.selects(i)]


# ---- the measurement ---------------------------------------------------------------------------------
@dataclass
class PPLResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # scored tokens over all windows
    chunks: list = field(default_factory=list)  # {"chunk", "start", "end", "perplexity", "tokens"}
    kv_all: float = 1.0  # relative KV size over all layers (dense layers count as read in full)
    kv_speculated: float = 1.0  # over the layers the policy does not keep dense
    # over the layers a policy may thin: all but a model's local sliding-window layers (Gemma 3's five of six),
    # which read their window whatever the policy (`Session.selects`); kv_all counts those at 100%
    kv_global: float = 1.0
    local_layers: list = field(default_factory=list)
    kv_per_layer: list = field(default_factory=list)
    speculated_layers: list = field(default_factory=list)
    window_perplexities: list = field(default_factory=list)
    ctx: int = 0
    prefill: int = 0
    windows: int = 1
    capacity: int | None = None  # KV pool tokens, when a limit below the window applies
    eviction: str | None = None
    kv_offload: str = "none"
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _nll_rows(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row NLL of targets [R] under the head's logits of hidden [R, H] (float64 result), the head a few
    hundred rows at a time (all rows' logits at once: [R, vocab])."""
    out = torch.empty(targets.shape[0], dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, targets.shape[0], SCORE_ROWS):
            e = min(targets.shape[0], s + SCORE_ROWS)
            logits = model.head(hidden[s:e][None])[0]
            out[s:e] = F.cross_entropy(logits.float(), targets[s:e], reduction="none").double().cpu()
    return out


class _LayerProgress:
    """Advances a tqdm bar once per layer (hooks on each block's MLP, which runs once per layer per call)."""

    def __init__(self, model, total: int, enabled: bool, desc: str):
        from tqdm.auto import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="layer", disable=not enabled, leave=False)
        self.hooks = [blk.mlp.register_forward_hook(self._tick) for blk in model.layers]

    def _tick(self, *_):
        self.bar.update(1)  # returns None: a forward hook's return value would replace the MLP output

    def close(self):
        for h in self.hooks:
            h.remove()
        self.bar.close()


def perplexity(model, tokenizer, text, policy=None, ctx: int = 2048, prefill: int = 256, windows: int = 1,
               placement: Placement | None = None, progress: bool = False, tokens: torch.Tensor | None = None,
               chunk: int = CHUNK) -> PPLResult:
    """Perplexity of `text` (path, corpus name or None with `tokens` [N, ctx]) under `policy`, the KV pool
    placed and limited by `placement` (its capacity may be a fraction of the window, e.g. 0.8)."""
    from ..policy import FullCache
    policy = (policy or FullCache()).prepare(model, tokenizer, progress=progress)
    placement = placement or Placement()
    if tokens is None:
        if windows < 1:
            raise UserError(f"--windows must be >= 1, got {windows}")
        tokens = token_windows(tokenizer, load_text(text), ctx, windows)
    windows, ctx = tokens.shape
    if ctx < 2 or prefill < 1 or prefill >= ctx:
        raise UserError(f"need 1 <= --prefill < --ctx (got prefill {prefill}, ctx {ctx})")
    limit = getattr(model.cfg, "max_position", None)
    if limit and ctx > limit and model.cfg.arch == "opt":  # learned positions end there
        raise UserError(f"--ctx {ctx} exceeds the model's {limit} positions")
    cap = placement.pool_tokens(model, 1, ctx, policy)
    if cap < prefill:
        raise UserError(f"a KV pool of {cap} tokens cannot hold the {prefill}-token prompt")
    use_pool = cap < ctx
    n_layers = model.cfg.num_layers
    n_chunks = -(-(ctx - prefill) // chunk)
    chunk_nll = torch.zeros(n_chunks, dtype=torch.float64)
    chunk_n = torch.zeros(n_chunks, dtype=torch.long)
    per_layer = torch.zeros(n_layers, dtype=torch.float64)
    kv_all = kv_spec = kv_global = 0.0
    global_layers = counted_layers(model)
    local = [i for i in range(n_layers) if i not in global_layers]
    window_ppl = []
    bar = _LayerProgress(model, windows * n_layers, progress, f"ppl {getattr(policy, 'name', 'policy')}")
    start = time.perf_counter()
    try:
        for w in range(windows):
            row = tokens[w:w + 1].to(model.device)
            sess = placement.new_session(model, 1, ctx, policy, prompt_len=prefill)
            try:
                hidden = runtime.teacher_forced(model, row, prefill, sess, head=False)[0]
            finally:
                sess.store.close()
            nll = _nll_rows(model, hidden[prefill - 1:ctx - 1], row[0, prefill:])
            del hidden
            window_ppl.append(math.exp(nll.mean().item()))
            idx = torch.arange(nll.shape[0]) // chunk
            chunk_nll.index_add_(0, idx, nll)
            chunk_n.index_add_(0, idx, torch.ones_like(idx))
            layers = sess.stats.per_layer()
            per_layer += torch.tensor(layers, dtype=torch.float64)
            kv_all += sess.stats.overall()
            kv_global += sess.stats.overall(global_layers)
            spec = speculated_layers(policy, n_layers)
            kv_spec += sess.stats.overall(spec) if spec else float("nan")
    finally:
        bar.close()
    total_nll, total_n = chunk_nll.sum().item(), int(chunk_n.sum())
    chunks = [{"chunk": j, "start": prefill + j * chunk, "end": min(ctx, prefill + (j + 1) * chunk),
               "tokens": int(chunk_n[j]), "perplexity": math.exp(chunk_nll[j].item() / int(chunk_n[j]))}
              for j in range(n_chunks)]
    return PPLResult(perplexity=math.exp(total_nll / total_n), nll=total_nll / total_n, tokens=total_n,
                     chunks=chunks, kv_all=kv_all / windows, kv_speculated=kv_spec / windows,
                     kv_global=kv_global / windows, local_layers=local,
                     kv_per_layer=(per_layer / windows).tolist(), speculated_layers=spec,
                     window_perplexities=window_ppl,
                     ctx=ctx, prefill=prefill, windows=windows, capacity=cap if placement.limited else None,
                     eviction=placement.evict if use_pool else None, kv_offload=placement.kv_offload,
                     seconds=time.perf_counter() - start)


from ..policy import jsonable  # noqa: E402,F401 (re-exported for the commands)
