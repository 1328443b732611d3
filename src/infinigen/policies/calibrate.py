"""Per-model calibration of InfiniGen's settings.

The presets fix the threshold, the caps and the dense layers from measurements on one model. Another model
has other attention statistics, so `InfiniGen.prepare` (knob `calibrate`) chooses them per model instead:
on held-apart calibration tokens (by default Mansfield Park; the skew matrices are calibrated on Emma, the
validation texts are never read), it runs the full cache once teacher-forced for the reference loss, then a
few candidates, and keeps the one that reads the fewest cached entries while its loss stays within `target`
(relative perplexity) of the full cache's, and whose caps stay under the `bound`. When no candidate under the
bound reaches the target, the one with the lowest loss wins (the bound is never given up for accuracy).

The bound is over the layers a policy may read sparsely (a model's local sliding-window layers read their
window in full whatever the policy: `Session.selects`), the layers a candidate keeps dense counting 100%: at
most `bound` of their entries averaged over a run of `ref` tokens whose first ref/8 are the prompt, and
`bound * (1/4) ** (1 - growth)` over a run of 4 * ref (the tokens read growing as n ** growth: 20% at 2048
and 10% at 8192 for growth 0.5). It is checked on the caps (an upper bound on what a selection reads: the
threshold only trims under them), so it holds at lengths the calibration did not run, and again on what the
calibration run measured.

The search is small (each candidate is one teacher-forced pass over `ref` tokens): the largest all-layer budget
under the bound for each way of treating layer 0 (selected with its exact query, or read densely); the better
one with what the selection leaves unread added from layer 0 on and from the layer after its first selecting
layer (`remainder`, `remainder_from`, unless the caller set them); then, if the best of these reaches the
target, a bisection down the budget and a lower threshold; at most `max_evals` passes after the reference.

How a candidate is scored: its teacher-forced loss over the rows after the prompt, as `runtime.teacher_forced`
computes it, with the work every candidate shares done once (`window`: one dense pass over the tokens for the
full cache's loss and the prompt's keys and values) and each candidate's rows chosen a block at a time
(`infinigen_select.rows_in_blocks`: the same selection up to float summation order). Where the fused kernel is
built (budget "layer"), a layer's rows are selected in C++, 256 rows per call, each row under its own cap
(`infinigen_select.rows_fused`); elsewhere the torch blocks do the same. Each row attends to its packed entries
as a decoding step does (`runtime.attend_rows`): no [rows, tokens] score tensor. A candidate's rows enter its
first selecting layer with the shared pass's hidden states (the layers before it read densely: `shared_layers`),
and over a vocabulary of BF16_HEAD_VOCAB tokens or more the loss head is a bfloat16 product with each row's
largest logits and its target's in float32 (`head_nll`: on Gemma 3 it moves a candidate's NLL by 1e-5 to 4e-5,
over twenty times less than the closest decision of its search: results/calibration/calibration_head.md). What
is left of a candidate's pass is mostly its dense layers from its first selecting one on and the head, work no
candidate shares with another; the fused kernel builds beside the shared pass.

A candidate's rows run BLOCK_ROWS at a time through every layer (`score_rows`), each block reading the keys and
values of the rows before it, so that its pass can stop early: after each block a paired test on the per-token
loss differences from the full cache (policies/calibrate_stop.py) ends the pass of a candidate that certainly
misses the target (at 99.9%, after 512 tokens at least); the trial records the tokens it scored and its loss
estimated from them. A candidate that reaches the target, or is close to it, runs to the end. Not on fewer rows
from the start, nor windows of rows after a dense past: the loss of one candidate has a sampling error of 0.3
points over the 1792 rows of a 2048-token run already, as much as what separates close candidates, and a dense
past hides the error that compounds through the keys and values of earlier rows read under the selection (up to
a point of perplexity on SmolLM2: results/calibration/).

Where no candidate reaches the target, the search tries the structural options one at a time on the best
setting before giving up (policies/calibrate_fallback.py): centred 4-bit keys (`key_centre`), then the other ways
of counting the budget (each KV head its own cap, "union", or its query heads' mean count, "per_head", instead of
one cap pooled over the layer); the choice records each option tried (`fallbacks`). Still out of reach, `prepare`
prints a warning line with the loss, what it chose and what it tried, and the record says `reached: false`.

Calibration runs in fast memory, so under the knob `query="auto"` it calibrates the selection by each layer's
own query; an offloaded session (speculation one layer ahead) uses the same alpha, budget and layer 0. A
policy that speculates ahead (`query="ahead"`) is scored by `score` itself (its speculation hears of every
row's hidden state one layer early).
"""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import runtime
from ..cache import SelectedRows
from ..kernels import fused_select
from ..placement import Placement
from ..selection import ALL, Rows
from ..skew import Progress
from .calibrate_head import HEAD_EXACT, head_nll  # noqa: F401 (HEAD_EXACT: read as calibrate's)
from .calibrate_bound import LONG, POSITIONS, caps_share, counted_layers, largest_budget
from .calibrate_fallback import options_in_order, try_structural
from .calibrate_stop import looks_of, misses_certainly

FORMAT = 4  # of the stored choice: bump when the search changes what it would choose
ALPHA_HIGH = 9.0  # the caps decide (measured on SmolLM2: results/presets/)
ALPHA_LOW = 7.0  # the threshold trims under the caps
SCORE_ROWS = 512  # logits rows turned into log-probabilities at once (a 262k vocabulary: Gemma 3)
BF16_HEAD_VOCAB = 131072  # from this vocabulary on (Gemma 3: 262k), where the head is most of a pass, it is
# mostly a bfloat16 product (`head_nll`); below it (SmolLM2: 49k) it is a small share and stays float32
BLOCK_ROWS = 256  # a candidate's rows run through every layer this many at a time (`score_rows`)
EARLY_STOP = True  # a candidate stops once it certainly misses the target (policies/calibrate_stop.py)


@dataclass
class Trial:
    knobs: dict
    nll: float
    kv: float  # share read over the counted layers, measured
    kv_caps: float  # the caps' share over a run of ref tokens (the bound's measure)
    kv_caps_long: float  # ... over a run of LONG * ref tokens
    rows: int | None = None  # the calibration tokens scored (fewer than all where it certainly missed the target)


@dataclass
class Choice:
    """What the calibration chose and why: JSON-able, stored in the skew artifact's metadata."""
    key: str
    knobs: dict  # the chosen values of the knobs the caller left to calibration
    reached: bool  # the target was met on the calibration tokens
    reference_nll: float
    nll: float
    kv: float
    kv_caps: float
    kv_caps_long: float
    target: float
    bound: float
    text: str
    tokens: int
    prefill: int
    trials: list = field(default_factory=list)  # every candidate tried: knobs, nll, kv, rows (tokens scored)
    # the structural options tried after the search missed the target: knobs, nll, kv, reached
    fallbacks: list = field(default_factory=list)

    def loss_vs_full(self) -> float:
        """Relative perplexity over the full cache on the calibration tokens."""
        return math.exp(self.nll - self.reference_nll) - 1

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict, key: str, allowed: set) -> "Choice":
        """A stored choice, checked (ValueError when it is not one this search would have written for `key`)."""
        if not isinstance(d, dict) or d.get("key") != key or d.get("format") != FORMAT:
            raise ValueError("not a choice for this model and these settings")
        knobs = d.get("knobs")
        if not isinstance(knobs, dict) or not set(knobs) <= allowed:
            raise ValueError("knobs missing or unknown")
        numbers = ("reference_nll", "nll", "kv", "kv_caps", "kv_caps_long", "target", "bound")
        if not all(isinstance(d.get(k), (int, float)) and math.isfinite(d[k]) for k in numbers):
            raise ValueError("numbers missing or not finite")
        if not isinstance(d.get("fallbacks", []), list) or not all(
                isinstance(f, dict) and isinstance(f.get("knobs"), dict) and set(f["knobs"]) <= allowed
                and isinstance(f.get("reached"), bool)
                and all(f.get(k) is None or isinstance(f.get(k), (int, float)) for k in ("nll", "kv"))
                for f in d.get("fallbacks", [])):
            raise ValueError("fallbacks not a list of tried options")
        names = [f for f in cls.__dataclass_fields__]
        return cls(**{k: d[k] for k in names if k in d})


def calibration_tokens(tokenizer, text: str, n: int) -> torch.Tensor:
    """The first `n` tokens of `text` as the tokenizer encodes an input by default (so with the BOS a
    model like Gemma expects first), [1, n]; fewer when the text is shorter."""
    ids: list[int] = []
    for chars in (12 * n + 1000, None):
        ids = tokenizer(text if chars is None else text[:chars], verbose=False)["input_ids"]
        if len(ids) >= n or chars is None or chars >= len(text):
            break
    return torch.tensor(ids[:n], dtype=torch.long)[None]


def score(model, tokens: torch.Tensor, prefill: int, policy) -> tuple[float, float]:
    """(mean NLL of the tokens after the prompt, share of the entries read over `counted_layers`), one
    teacher-forced pass under `policy` (the same selection as decoding)."""
    sess = Placement().new_session(model, 1, tokens.shape[1], policy, prompt_len=prefill)
    try:
        with torch.no_grad():
            h = runtime.teacher_forced(model, tokens.to(model.device), prefill, sess, head=False)
    finally:
        sess.store.close()
    targets = tokens[0, prefill:].to(model.device)
    with torch.no_grad():
        total = float(_nll(model, h[0, prefill - 1:-1], targets).double().sum())
    return total / targets.numel(), _counted_share(model, sess.stats.per_layer())


def _counted_share(model, per_layer: list) -> float:
    counted = [per_layer[i] for i in counted_layers(model) if not math.isnan(per_layer[i])]
    return sum(counted) / len(counted) if counted else 1.0


@dataclass
class Window:
    """The rows a candidate is scored on, from `first` on, every token before them read densely. One dense
    pass over every token (`window`) gives the full cache's loss on them and the keys and values of the
    tokens before them, shared by every candidate, so a candidate costs its rows alone."""
    tokens: torch.Tensor  # [1, T] the calibration tokens
    first: int  # the window's first row (tokens before it are its dense prefix)
    prefix: list  # per layer (keys, values) [1, Hkv, first, d] as the store holds them
    first_nll: float  # NLL of tokens[first], predicted by the prefix's last row (dense whatever the candidate)
    reference_nll: float  # the full cache's mean NLL of tokens[first:]
    inputs: list = field(default_factory=list)  # per layer, its input hidden states of the rows [1, T - first, h]
    reference_nlls: torch.Tensor | None = None  # the full cache's NLL of each of tokens[first:], float64


def window(model, tokens: torch.Tensor, first: int) -> Window:
    """The shared part of scoring the rows from `first` on: one dense pass over every token (a prefill of the
    whole sequence, its hidden states kept) gives the full cache's loss on them and, the attention being
    causal, the keys and values of the tokens before them."""
    tokens = tokens.to(model.device)
    t = tokens.shape[1]
    sess = Placement().new_session(model, 1, t, None, prompt_len=t)
    try:
        with torch.no_grad():
            positions = torch.arange(t, device=tokens.device)[None]
            sess.begin_prefill(positions, torch.ones_like(tokens, dtype=torch.bool))
            h = model.embed(tokens, positions)
            rope = model.rope(positions)
            inputs = []
            for block in model.layers:
                inputs.append(h[:, first:].clone())
                h = block(h, rope, sess.attend, sess.event)
            nll = _nll(model, h[0, first - 1:-1], tokens[0, first:])
        prefix = [tuple(x[:, :, :first].clone() for x in sess.store.used_keys_values(i))
                  for i in range(model.cfg.num_layers)]
    finally:
        sess.store.close()
    return Window(tokens, first, prefix, float(nll[0]), float(nll.mean()), inputs, nll.double())


def _nll(model, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per target, its NLL from the hidden states `rows` [n, hidden] (the head's logits SCORE_ROWS at a time;
    from BF16_HEAD_VOCAB tokens on, through `head_nll`, in the search's reused buffers)."""
    low = _bf16_head(model)
    out = []
    for s in range(0, rows.shape[0], SCORE_ROWS):
        r, t = rows[s:s + SCORE_ROWS], targets[s:s + SCORE_ROWS]
        if low is None:
            out.append(F.cross_entropy(model.head(r[None])[0].float(), t, reduction="none"))
        else:
            out.append(head_nll(_head_input(model, r), model.lm_head.weight, low, t, model.cfg.final_softcap,
                                buffers=getattr(_HEAD_BUFFERS, "held", None)))
    return torch.cat(out)


# within a search, per thread: the head's logits buffers, reused by every chunk of rows (a 262k vocabulary's
# [SCORE_ROWS, vocab] float32 logits are hundreds of MB, which a fresh allocation maps and faults in each time)
_HEAD_BUFFERS = threading.local()


def _head_input(model, h: torch.Tensor) -> torch.Tensor:
    """What `model.head` hands its output projection (the final norm, OPT's projection)."""
    if model.norm is not None:
        h = model.norm(h)
    if model.cfg.arch == "opt" and model.project_out is not None:
        h = model.project_out(h)
    return h


_LOW_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _bf16_head(model) -> torch.Tensor | None:
    """The output projection's weight in bfloat16 (kept until `search` ends, made again when the weight
    changes), where `head_nll` scores this model: a float32 nn.Linear without bias over at least
    BF16_HEAD_VOCAB tokens whose `model.head` is `_head_input` then that projection; else None (the exact head)."""
    lm = getattr(model, "lm_head", None)
    if type(lm) is not torch.nn.Linear or lm.bias is not None or lm.weight.dtype != torch.float32:
        return None
    w = lm.weight
    if w.shape[0] < BF16_HEAD_VOCAB:
        return None
    stamp = (w.data_ptr(), w._version)
    held = _LOW_HEADS.get(model)
    if held is None or held[0] != stamp:
        probe = torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device)
        with torch.no_grad():
            logits = F.linear(_head_input(model, probe), w).float()
            if model.cfg.final_softcap is not None:
                logits = torch.tanh(logits / model.cfg.final_softcap) * model.cfg.final_softcap
            if not torch.equal(logits, model.head(probe[None])[0].float()):
                return None  # a head this does not know how to split
            held = (stamp, w.detach().to(torch.bfloat16))
        _LOW_HEADS[model] = held
    return held[1]


def score_window(model, win: Window, policy, blocks: bool = True) -> tuple[float, float]:
    """`score` of the rows from `win.first` on, with the tokens before them read densely (their keys and
    values shared, `window`): the teacher-forced decoding rows of `runtime` (the policy's `keep` of every row
    of a block at once, `runtime.attend_rows`), run over the window's rows only. With the window's first row at
    the prompt's end it is `score` itself (up to float summation order). The policy must select with each
    layer's own query (speculation one layer ahead hears of every row's hidden state: `score` runs it)."""
    scored = score_rows(model, win, policy, blocks)
    return scored.nll, scored.kv


@dataclass
class Scored:
    """A candidate's pass over a window's rows (`score_rows`)."""
    nll: float  # mean NLL of the window's tokens; where the pass stopped early, the full cache's plus the mean
    # difference over the tokens scored (an estimate)
    kv: float  # share read over `counted_layers`, on the rows run
    rows: int  # the window's tokens scored
    total: int  # the window's tokens


def score_rows(model, win: Window, policy, blocks: bool = True, block_rows: int | None = None,
               stop=None) -> Scored:
    """`score_window`, its rows run `block_rows` at a time (default BLOCK_ROWS) through every layer, each block
    reading the keys and values of the rows before it as computed (the same selection of every row, so the same
    losses up to float rounding); after each block but the last, `stop(diffs)` is asked with the per-token NLL
    differences from the full cache's so far (`calibrate_stop.misses_certainly`): True ends the pass there."""
    tokens, p = win.tokens, win.first
    t = tokens.shape[1]
    block_rows = max(1, block_rows or BLOCK_ROWS)
    if policy is not None and getattr(policy, "key_centre", False):
        block_rows = t  # centred keys are centred on the keys before the first row selected: one block
    sess = Placement().new_session(model, 1, t, policy, prompt_len=p)
    if policy is not None and not getattr(sess.state, "own_query", False):
        sess.store.close()
        raise ValueError("a window scores a policy that selects with each layer's own query")
    if policy is not None:
        sess.state.rows_in_blocks = blocks
    positions = torch.arange(t, device=tokens.device)[None]
    sess.begin_teacher(positions, p)
    held = list(win.prefix)  # per layer, the keys and values of every token before the block being run
    span = [p, p]  # the block: rows span[0]..span[1] - 1

    def in_view(layer):  # what each row sees densely: its past, within the layer's window; its past's length
        row_pos, cols = positions[0, span[0]:span[1], None], positions[:, :span[1]]
        visible, past = cols < row_pos, row_pos.T
        if model.window(row_pos, cols, layer) is not None:
            visible = visible & model.window(row_pos, cols, layer)
            past = past.clamp(max=model.cfg.window(layer) - 1)
        return visible, past, row_pos, cols

    def attend(layer, q, k, v):
        b0, b1 = span
        k, v = torch.cat([held[layer][0], k], 2), torch.cat([held[layer][1], v], 2)
        held[layer] = (k, v)
        visible, past, row_pos, cols = in_view(layer)
        rows = Rows(first=b0, positions=positions[:, b0:b1], entry_pos=cols[None], valid=(cols < row_pos)[None, None],
                    in_store=False, query=q, own_keys=k[:, :, b0:], keys=k)
        keep = sess.policy.keep(layer, rows, sess) if sess.selects(layer) else ALL
        if isinstance(keep, SelectedRows):  # packed per row by the fused kernel (a layer without a window)
            sess.stats.record(layer, keep.counts.T[None], row_pos.T.expand(1, 1, b1 - b0))
            remainder = sess.policy.remainder_at(layer, sess)
            return runtime.attend_rows(q, k, v, keep, b0, sess.store.codec, model.scale, remainder)
        dense = keep is ALL
        keep = visible[None, None] if dense else keep & visible
        sess.stats.record(layer, keep.sum(-1).expand(1, k.shape[1], b1 - b0), past.expand(1, 1, b1 - b0))
        beside = None if dense else sess.policy.keys_beside(layer, sess)
        if beside is not None:  # a re-rank's candidates' keys
            sess.stats.record_keys(layer, beside, past.expand(1, 1, b1 - b0))
        remainder = sess.policy.remainder_at(layer, sess)
        if dense and remainder is None and sess.store.codec.encode(k) is k:  # every entry in view: one fused call
            return runtime.attend_visible(q, k, v, visible, b0, model.scale)
        return runtime.attend_rows(q, k, v, keep, b0, sess.store.codec, model.scale, remainder)

    nlls = [torch.tensor([win.first_nll], dtype=torch.float64)]  # per token of the window, as scored
    try:
        with torch.no_grad():
            shared = shared_layers(model, win, sess)
            for b0 in range(p, t, block_rows):
                span[:] = b0, min(t, b0 + block_rows)
                h = _run_block(model, win, sess, shared, span, attend, in_view)
                targets = tokens[0, span[0] + 1:span[1] + 1]
                nlls.append(_nll(model, h[0, :targets.numel()], targets).double())
                if stop is not None and span[1] < t:
                    got = torch.cat(nlls)
                    if stop(got - win.reference_nlls[:got.numel()]):
                        break
    finally:
        sess.store.close()
    got = torch.cat(nlls)
    n, total = got.numel(), t - p
    nll = float(got.sum()) / total if n == total else win.reference_nll + float(
        (got - win.reference_nlls[:n]).mean())
    return Scored(nll, _counted_share(model, sess.stats.per_layer()), n, total)


def _run_block(model, win: Window, sess, shared: int, span: list, attend, in_view) -> torch.Tensor:
    """The rows span[0]..span[1] - 1 through every layer, their last hidden states: the first `shared` layers
    read densely, as in the window's pass (its hidden states, its reads), the rest with `attend`."""
    b0, b1 = span
    p = win.first
    for layer in range(shared):
        visible, past, _, _ = in_view(layer)
        sess.stats.record(layer, visible.sum(-1)[None, None].expand(1, model.cfg.num_kv_heads, b1 - b0),
                          past.expand(1, 1, b1 - b0))
    positions = torch.arange(b0, b1, device=win.tokens.device)[None]
    h = win.inputs[shared][:, b0 - p:b1 - p] if shared else model.embed(win.tokens[:, b0:b1], positions)
    rope = model.rope(positions)
    for block in model.layers[shared:]:
        h = block(h, rope, attend, lambda *a: None)  # own queries: nothing is speculated ahead
    return h


def shared_layers(model, win: Window, sess) -> int:
    """How many of the first layers the session reads densely (the policy selects on none of them), so that a
    candidate's rows enter the first layer it selects on with the window pass's hidden states (the same up to
    float summation order). 0 where the window kept none, or the store encodes the keys (a dense read then
    differs from the window pass's)."""
    if not win.inputs or sess.store.codec.encode(win.prefix[0][0]) is not win.prefix[0][0]:
        return 0
    n = 0
    while n < model.cfg.num_layers - 1 and not sess.selects(n):
        n += 1
    return n


def search(model, tokens: torch.Tensor, prefill: int, candidate, structures: list[dict], alphas: tuple,
           budget_free: bool, target: float, bound: float, growth: float, ref: int, key: str, text: str,
           max_evals: int = 8, log=None, remainder_starts=None, progress=False, own_query: bool = True,
           budgets: tuple = (), key_options: tuple = ()) -> Choice:
    """Choose the knobs (see the module docstring). `candidate(knobs)` makes the policy of a candidate (knobs:
    the values calibration chooses; the caller's own knobs are fixed inside it); `structures`: the ways to
    treat layer 0 (knob dicts of exact_first, dense_layers; [{}] when the caller fixed them), `alphas` the
    thresholds tried (the first with every structure; none when the caller fixed it); `budget_free`: choose
    kv_budget (else the caller's cap is the bound). `remainder_starts(knobs)`, unless None (the caller set the
    remainder): the first layers from which to add what the selection leaves unread, each tried on the best
    structure (a pass each: it helps some layers and hurts others, measured in results/accuracy/) before the
    budget is lowered, so the budget search runs on the better of them. Where the target is out of reach, the
    `key_options` (knob dicts: `calibrate_fallback.key_options`) then the other ways to count the budget
    (`budgets`, knob `budget`) are tried on the best setting. `own_query`: the
    candidates select with each layer's own query, so they are scored with the shared pass (`window`,
    `score_window`); else each by `score`. `progress`: passes done of at most
    1 + max_evals (+ the structural options), with an ETA (`skew.Progress`); `log` gets a line per candidate."""
    fallbacks = options_in_order(key_options, budgets)
    _HEAD_BUFFERS.held = {}
    bar = Progress(progress, "calibrating InfiniGen", 1 + max_evals + len(fallbacks), "pass")
    if log and progress:
        log = bar.write
    try:
        choice = _search(model, tokens, prefill, candidate, structures, alphas, budget_free, target, bound,
                         growth, ref, key, text, max_evals, log, remainder_starts, bar, own_query, fallbacks)
    finally:
        bar.finish()
        _LOW_HEADS.pop(model, None)  # the bfloat16 head and its buffers live as long as the search
        _HEAD_BUFFERS.held = None
    return choice


def _halve_budget(run, best, goal, spent) -> None:
    """Two bisection steps between 0 and the best trial's kv_budget toward the smallest that still reaches the
    goal (each `run` is recorded as a trial); stops when `spent()`."""
    lo, hi = 0.0, best.knobs["kv_budget"]
    for _ in range(2):
        if spent():
            break
        mid = round((lo + hi) / 2, 4)
        try:
            t = run(dict(best.knobs, kv_budget=mid))
        except Exception:  # the dense layers alone exceed it
            lo = mid
            continue
        lo, hi = (lo, mid) if t.nll <= goal else (mid, hi)


def _at_largest_budget(knobs, candidate, model, ref, bound, growth, budget_free) -> dict | None:
    """`knobs` at the largest kv_budget under the bound (as they are when the budget is the caller's); None
    where no budget fits."""
    if not budget_free:
        return knobs
    top = largest_budget(lambda b: candidate(dict(knobs, kv_budget=b)), model, ref, bound, growth)
    return None if top is None else dict(knobs, kv_budget=round(top, 4))


def _scorer(model, tokens, prefill, own_query, margin: float):
    """(how a candidate's policy is scored: its (NLL, KV share, tokens scored), the full cache's NLL); with the
    window's scoring and EARLY_STOP, a candidate stops once its NLL certainly exceeds the full cache's by more than
    `margin` (`calibrate_stop.misses_certainly`)."""
    total = tokens.shape[1] - prefill
    if not own_query:
        return (lambda pol: (*score(model, tokens, prefill, pol), total)), score(model, tokens, prefill, None)[0]
    # the fused kernel (a fresh cache's first build: a compiler on one core for a minute or two) builds while
    # the shared dense pass runs; the candidates after it use it
    builder = threading.Thread(target=fused_select.available, daemon=True)
    builder.start()
    win = window(model, tokens, prefill)
    builder.join()
    looks = looks_of(total, BLOCK_ROWS)
    stop = (lambda diffs: misses_certainly(diffs, total, margin, looks)) if EARLY_STOP else None

    def measure(pol):
        scored = score_rows(model, win, pol, stop=stop)
        return scored.nll, scored.kv, scored.rows
    return measure, win.reference_nll


def _search(model, tokens, prefill, candidate, structures, alphas, budget_free, target, bound, growth, ref,
            key, text, max_evals, log, remainder_starts, bar, own_query, fallbacks) -> Choice:
    measure, full = _scorer(model, tokens, prefill, own_query, math.log1p(target))
    bar.update()
    goal = full + math.log1p(target)
    trials: list[Trial] = []
    total = tokens.shape[1] - prefill

    def run(knobs):
        pol = candidate(knobs)
        nll, kv, rows = measure(pol)
        t = Trial(dict(knobs), nll, kv, caps_share(pol, model, ref, ref // 8),
                  caps_share(pol, model, LONG * ref, LONG * ref // 8, POSITIONS // 2), rows)
        trials.append(t)
        bar.update()
        if log:
            stopped = f" (missed the target: stopped after {rows} of {total} tokens)" if rows < total else ""
            log(f"  {knobs}: {100 * (math.exp(nll - full) - 1):+.2f}% vs full, {100 * kv:.1f}% of the KV read{stopped}")
        return t

    # what a trial costs: what it reads; at equal reads (the threshold trims under the caps) the tighter caps
    cost = lambda t: (t.kv, t.kv_caps, t.nll)  # noqa: E731
    # under the bound: on the caps, and on what the run read where it ran to the end (a row reads a larger share of
    # a shorter past, so the first rows of a stopped candidate overstate its reads)
    ok = lambda t: (t.rows < total or t.kv <= bound + 1e-9) and t.kv_caps <= bound + 1e-9  # noqa: E731

    def pick(tried):  # (the choice, whether it reaches the target): the cheapest that does, else the lowest loss
        fit = [t for t in tried if t.nll <= goal and ok(t)]
        if fit:
            return min(fit, key=cost), True
        return min([t for t in tried if ok(t)] or tried, key=lambda t: (t.nll, t.kv)), False

    tops = []
    for s in structures:
        knobs = dict(s, alpha=alphas[0]) if alphas else dict(s)
        if remainder_starts is not None:
            knobs["remainder"] = False
        if budget_free:
            top = largest_budget(lambda b: candidate(dict(knobs, kv_budget=b)), model, ref, bound, growth)
            if top is None:
                continue
            knobs["kv_budget"] = round(top, 4)
        tops.append(run(knobs))
        if len(trials) >= max_evals:
            break
    if not tops:
        raise ValueError("no candidate fits the bound")
    best = min(tops, key=lambda t: (t.nll, t.kv))
    if remainder_starts is not None:
        for start in remainder_starts(best.knobs):
            tops.append(run(dict(best.knobs, remainder=True, remainder_from=start)))
        best = min(tops, key=lambda t: (t.nll, t.kv))
    if best.nll <= goal:
        # the target holds at the top of the budget: find the smallest budget that still reaches it
        if budget_free:
            _halve_budget(run, best, goal, lambda: len(trials) >= max_evals)
        for a in alphas[1:]:
            if len(trials) >= max_evals:
                break
            fit = [t for t in trials if t.nll <= goal and ok(t)]
            cheapest = min(fit, key=cost) if fit else best
            run(dict(cheapest.knobs, alpha=a))
    chosen, reached = pick(trials)
    tried = []
    if not reached and fallbacks:
        # the target is out of reach with the search's knobs: the structural options on the best setting, at the
        # largest budget under the bound, before giving up (policies/calibrate_fallback.py)
        tried = try_structural(
            run, lambda: min([t for t in trials if ok(t)] or trials, key=lambda t: (t.nll, t.kv)), fallbacks,
            lambda knobs: _at_largest_budget(knobs, candidate, model, ref, bound, growth, budget_free),
            lambda t: t.nll <= goal and ok(t))
        chosen, reached = pick(trials)
    return Choice(key=key, knobs=chosen.knobs, reached=reached, reference_nll=full, nll=chosen.nll, kv=chosen.kv,
                  kv_caps=chosen.kv_caps, kv_caps_long=chosen.kv_caps_long, target=target, bound=bound,
                  text=text, tokens=int(tokens.shape[1]), prefill=prefill,
                  trials=[{"knobs": t.knobs, "nll": t.nll, "kv": t.kv, "rows": t.rows} for t in trials],
                  fallbacks=tried)
