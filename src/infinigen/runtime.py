"""The decoding step: sessions, and the three passes a model runs over them.

    prefill(model, tokens, session)          the prompt, dense causal attention, keys/values to the store
    decode(model, tokens, sessions)          one new token per row, for one session or many at once (the
                                             server's batch, a fan-out): each layer reads what the
                                             session's policy keeps, in one batched attention call
    teacher_forced(model, tokens, p, session)
                                             a whole sequence, every position after the first p as if
                                             decoded one token at a time with the session's policy
                                             (perplexity, log-likelihood scoring)

The network (`infinigen.model`) runs the blocks; a block asks `attend(layer, q, k, v)` for its attention
and tells `event(layer, point, x)` that a hidden state is ready. A `Session` answers both for one batch of
requests: its policy's selection, its KV store, its listeners and its cursor (which tokens are being
processed). `Session.attend` is the one entry point of attention on every path, `infinigen.hf` included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from .cache import SelectedRows
from .kernels import fused_select
from .policy import FullCache, Policy
from .selection import ALL, All, Remainder, Rows, first_key_read

ROW_CHUNK = 1024  # teacher-forced decoding rows per attention call: bounds the score matrix at long contexts


# ---- the relative KV size ---------------------------------------------------------------------------------
@dataclass
class KVStats:
    """Relative KV size: the fraction of past entries each layer's attention read, per decoding step (of
    those its full cache reads: a sliding-window layer's whole window)."""
    num_layers: int
    read: list = field(default_factory=list)
    steps: list = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget what was recorded (e.g. the prefill's, to measure decoding alone)."""
        self.read = [0.0] * self.num_layers
        self.steps = [0] * self.num_layers
        self.entries = [0] * self.num_layers  # entries attended (selected and valid), summed over rows and steps
        self.rows = [0] * self.num_layers  # rows of keys (and as many of values) attention read from the store
        self._pending = []  # (layer, selected, past): reduced in bulk, off the per-layer decode path

    def record_rows(self, layer: int, rows: int) -> None:
        """Attention at `layer` read `rows` rows of keys and as many of values from the store (a host number:
        what a gather moved, padding included, or the used slots a dense read covers)."""
        self.rows[layer] += rows

    def record(self, layer: int, selected: torch.Tensor, past: torch.Tensor) -> None:
        """selected [B, Hkv, R] entries read and past [B, 1|Hkv, R] tokens before each row."""
        self._pending.append((layer, selected, past.clone()))  # past may be a view of live positions
        if len(self._pending) >= 2048:
            self._flush()

    def _flush(self) -> None:
        """Fold pending records into `read`/`steps`, one stacked computation per shape."""
        pending, self._pending = self._pending, []
        groups: dict = {}
        for item in pending:
            groups.setdefault((item[1].shape, item[2].shape, item[1].device), []).append(item)
        for items in groups.values():
            sel = torch.stack([s for _, s, _ in items]).float()
            past = torch.stack([p for _, _, p in items]).float().clamp(min=1)
            fracs = (sel / past).mean(dim=(1, 2)).sum(-1).tolist()
            totals = sel.sum(dim=(1, 2, 3)).tolist()
            for (layer, s, _), f, n in zip(items, fracs, totals):
                self.read[layer] += f
                self.steps[layer] += s.shape[-1]
                self.entries[layer] += int(n)

    def record_all(self, layer: int, batch: int, kv_heads: int, past: int) -> None:
        """One decoding row per batch row read every one of its `past` entries (all valid past tokens)."""
        self.read[layer] += 1.0
        self.steps[layer] += 1
        self.entries[layer] += batch * kv_heads * past

    def per_layer(self) -> list[float]:
        self._flush()
        return [r / s if s else float("nan") for r, s in zip(self.read, self.steps)]

    def per_step(self) -> dict:
        """Per decoding step, summed over the layers: the entries attention attended (selected, every row and
        KV head) and the rows it read from the store to do so (`record_rows`); None before any step."""
        self._flush()
        done = [i for i, s in enumerate(self.steps) if s]
        if not done:
            return {"entries_attended": None, "rows_read": None}
        return {"entries_attended": sum(self.entries[i] / self.steps[i] for i in done),
                "rows_read": sum(self.rows[i] / self.steps[i] for i in done)}

    def overall(self, layers=None) -> float:
        vals = [f for i, f in enumerate(self.per_layer()) if (layers is None or i in layers) and not math.isnan(f)]
        return sum(vals) / len(vals) if vals else float("nan")


# ---- listeners -----------------------------------------------------------------------------------------------
class Listener:
    """Hears what a session computes, after its policy and before placement, and changes nothing of it:
    calibration, fan-out, probes and recorders are listeners (`Placement.new_session(..., listeners=[...])`).

    on_prefill(layer, q, k, v)        a prompt's queries, keys and values at `layer` (already stored)
    on_hidden(layer, point, x)        a hidden state is ready (see `infinigen.policies.base`)
    on_select(layer, rows, keep)      what decoding rows read at `layer`: keep [B|1, Hkv|1, R, S] over
                                      rows' candidates (`infinigen.selection.Rows`) or ALL, as the policy
                                      said it (before invalid entries and the window are removed)
    on_append(layer, slots, k, v)     the current token was stored in `slots`
    """
    # wants every decoding row as decoding sees it (on_select before, on_append after each row's
    # attention, the store holding the row's past): teacher-forced scoring then replays row by row
    per_row: ClassVar[bool] = False

    def on_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session: "Session") -> None:
        pass

    def on_hidden(self, layer: int, point: str, x: torch.Tensor, session: "Session") -> None:
        pass

    def on_select(self, layer: int, rows: Rows, keep: torch.Tensor | All, session: "Session") -> None:
        pass

    def on_append(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, session: "Session") -> None:
        pass


# ---- attention -------------------------------------------------------------------------------------------------
def attend_all(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per row, q [B,H,1,d], over every entry of kp, vp [B,Hkv,S,d] (its own included): one
    fused call, no mask, no weights kept."""
    b, h, _, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, kp.shape[1], h // kp.shape[1], d), kp, vp, scale=scale)
    return out.reshape(b, h, 1, d)  # CUDA's fused kernels return [B,Hkv,G,d] with G outermost: no view


def attend_masked(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor, scale: float):
    """One token per row, q [B,H,1,d], over the entries of kp, vp [B,Hkv,S,d] where mask [B,Hkv,S] (its own
    included), or mask [B,Hkv,G,S] per query head of each group: one fused call, no weights kept."""
    b, h, _, d = q.shape
    hkv = kp.shape[1]
    mask = mask[:, :, None] if mask.dim() == 3 else mask
    out = F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), kp, vp, attn_mask=mask, scale=scale)
    return out.reshape(b, h, 1, d)  # as in attend_all


def attend_step(q, kp, vp, mask, kc, vc, scale: float):
    """One token per row, q [B,H,1,d], over the past entries kp, vp [B,Hkv,n,d] where mask [B,Hkv,n], and
    over itself (kc, vc [B,Hkv,1,d], kept apart from the past: nothing is copied). Returns the output
    [B,H,1,d] and the weights probs [B,Hkv,G,n+1] (the current token last)."""
    b, h, _, d = q.shape
    hkv = kp.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    s_past = torch.matmul(qg, kp.transpose(-1, -2)).float() * scale
    s_past = torch.where(mask[:, :, None, :], s_past, float("-inf"))
    s_cur = (qg.float() * kc.float()).sum(-1, keepdim=True) * scale
    probs = torch.softmax(torch.cat([s_past, s_cur], dim=-1), dim=-1)
    out = torch.matmul(probs[..., :-1].to(vp.dtype), vp) + probs[..., -1:].to(vc.dtype) * vc
    return out.view(b, h, 1, d), probs


def attend_rows(q, k, v, keep, first: int, codec, scale: float, rest: Remainder | None = None) -> torch.Tensor:
    """Decoding rows q [B,H,R,d] (positions first..first+R-1 of a sequence with keys and values k, v
    [B,Hkv,T,d]) at once: each reads the entries in keep [B,Hkv,R,T] plus itself, past entries as the
    store would hold them (`codec`), its own token as computed; plus what the policy estimates the unread
    entries add (`rest`, see `Remainder`: their mean value from the sequence's values)."""
    b, h, r, d = q.shape
    t = k.shape[2]
    p = first
    rows = torch.arange(p, p + r, device=q.device)[:, None]
    cols = torch.arange(t, device=q.device)[None, :]
    kq, vq = codec.encode(k), codec.encode(v)
    diag = (cols == rows)[None, None]
    hkv, g = k.shape[1], h // k.shape[1]
    qg = q.view(b, hkv, g, r, d)
    out = torch.empty_like(qg)
    lse = None if rest is None else q.new_empty(b, hkv, g, r, dtype=torch.float32)
    for s in range(0, r, ROW_CHUNK):
        e = min(r, s + ROW_CHUNK)
        # the keys some row of the chunk reads or is: [lo, hi). The rest (the future; behind a sliding window,
        # the past: a 512-token window at 32K tokens) would get a weight of exactly 0
        hi = min(t, p + e)
        lo = min(first_key_read(keep[:, :, s:e, :hi], hi), p + s)
        qc = qg[:, :, :, s:e]
        scores = torch.matmul(qc, kq[:, :, None, lo:hi].transpose(-1, -2)).float() * scale  # [B,Hkv,G,c,n]
        own = (qc.float() * k[:, :, None, p + s:p + e].float()).sum(-1) * scale  # [B,Hkv,G,c]
        scores = scores.masked_fill(~keep[:, :, None, s:e, lo:hi], float("-inf"))
        dg = diag[:, :, None, s:e, lo:hi]
        scores = torch.where(dg, own[..., None], scores)
        probs = torch.softmax(scores, dim=-1)
        if lse is not None:
            lse[..., s:e] = torch.logsumexp(scores, -1)
        pd = (probs * dg).sum(-1, keepdim=True)
        past = torch.matmul(probs.masked_fill(dg, 0).to(vq.dtype), vq[:, :, None, lo:hi])
        out[:, :, :, s:e] = past + pd.to(v.dtype) * v[:, :, None, p + s:p + e]
    out = out.view(b, h, r, d)
    if rest is None:
        return out
    vf = vq.float()
    totals = F.pad(vf.cumsum(2), (0, 0, 1, 0))[:, :, p:p + r]  # [B, Hkv, R, d]: every entry before each row
    counts = torch.arange(p, p + r, device=q.device)
    read = keep.float()
    return _with_remainder(out, lse, rest.lse, totals - read @ vf, counts - read.sum(-1))


def _with_remainder(out, lse_read, lse_unread, unread_sum, unread_count) -> torch.Tensor:
    """out [B,H,R,d] attention over what was read, whose exact scaled scores have the log-sum-exp lse_read
    [B,Hkv,G,R]; the unread past entries' estimated log-mass lse_unread [B,Hkv,G,R], their values' sum
    unread_sum [B,Hkv,R,d] and count [B,Hkv,R] -> (1 - w) * out + w * their mean, w their share of the mass.
    Nothing unread (count 0, or a log-mass of -inf): w is 0 and out is returned to the bit."""
    b, h, r, d = out.shape
    hkv = lse_unread.shape[1]
    lse_unread = lse_unread.masked_fill((unread_count <= 0)[:, :, None], float("-inf"))
    w = torch.sigmoid(lse_unread - lse_read)[..., None]  # exp(u) / (exp(u) + exp(read))
    mean = (unread_sum / unread_count.clamp(min=1)[..., None])[:, :, None]  # [B, Hkv, 1, R, d]
    o = out.view(b, hkv, h // hkv, r, d).float()
    return (o + w * (mean - o)).to(out.dtype).view(b, h, r, d)


def _plus_unread(out, rest: Remainder, q, kp, mask, scale: float, own_k=None, read_sum=None, read_count=None):
    """A decoding step's `_with_remainder`: out [B,H,1,d] attention of q [B,H,1,d] over the entries of kp
    [B,X,S,d] where mask ([B,X,G|H,S]; X = Hkv, or 1 for packed rows) and its own key own_k [B,Hkv,1,d] when
    kept apart; what it read of the past sums to read_sum [B,Hkv,d] over read_count [B,Hkv] entries."""
    b, h, _, d = q.shape
    x = kp.shape[1]
    qg = q.view(b, x, h // x, d)
    scores = torch.matmul(qg.float(), kp.float().transpose(-1, -2)) * scale  # (a 16-bit bmm is slower on a CPU)
    scores = scores.masked_fill(~mask, float("-inf"))
    if own_k is not None:
        own = (q.view(b, own_k.shape[1], -1, d).float() * own_k.float()).sum(-1, keepdim=True) * scale
        scores = torch.cat([scores, own.view(b, x, h // x, 1)], -1)
    hkv = rest.lse.shape[1]
    lse = torch.logsumexp(scores, -1).view(b, hkv, h // hkv, 1)
    return _with_remainder(out, lse, rest.lse, (rest.sums - read_sum)[:, :, None],
                           (rest.counts - read_count)[:, :, None])


def _plus_unread_rows(out, rest: Remainder, q, kp, vp, head, hkv: int, scale: float):
    """`_plus_unread` over packed rows kp, vp [B,1,m,d] whose KV heads are head [B,m] (-1: padding), the
    row's own tokens the last hkv columns."""
    b, m = head.shape
    d = vp.shape[-1]
    past = head[:, :m - hkv]
    # each past row's (batch row, KV head), padding to a spare last segment
    seg = torch.where(past >= 0, past + hkv * torch.arange(b, device=head.device)[:, None], b * hkv).reshape(-1)
    sums = vp.new_zeros(b * hkv + 1, d, dtype=torch.float32)
    sums.index_add_(0, seg, vp[:, 0, :m - hkv].reshape(-1, d).float())
    counts = torch.bincount(seg, minlength=b * hkv + 1)
    return _plus_unread(out, rest, q, kp, _head_mask(head, q.shape[1], hkv), scale,
                        read_sum=sums[:-1].view(b, hkv, d), read_count=counts[:-1].view(b, hkv))


class _Read(NamedTuple):
    """What one session's decoding row reads at a layer, before the attention runs."""
    cur: torch.Tensor  # [B] position of the row's token
    keep: torch.Tensor | All  # the selection (over the store's slots)
    seen: torch.Tensor  # [B, Hkv, S] the slots the selection read, for the pool's counters
    keys: torch.Tensor | None  # [B, Hkv, n, d] what attention reads (None: read in place, fused)
    values: torch.Tensor | None
    mask: torch.Tensor | None  # [B, Hkv, n]
    idx: torch.Tensor | All  # the slots of keys/values (ALL: every used slot, in order)
    full: bool  # every entry of keys/values counts (mask is all True): no padding, window or selection
    rows: SelectedRows | None = None  # the selection packed per batch row (`KVStore.select_rows`): read by
    # `Session._attend_selected` with the current token stored first; None: the reference path (keys/values,
    # or in place)


# ---- sessions ----------------------------------------------------------------------------------------------------
class Session:
    """One batch of requests in flight: the model, its KV store, the policy and the policy's state for
    these requests (`policy.begin`), listeners, and the cursor: which tokens are being processed.

    The cursor changes only through `begin_prefill`, `begin_teacher`, `begin_step`, `move_to_row` and
    `end_step`; it is read through `positions`, `row`, `first_row`, `next_pos`, `prompt_valid` and `phase`.
    """

    def __init__(self, model, store, policy: Policy | None = None, batch: int = 1,
                 listeners: Sequence[Listener] = ()):
        self.model, self.store = model, store
        self.policy = policy or FullCache()
        self.listeners = tuple(listeners)
        self.stats = KVStats(model.cfg.num_layers)
        self._next_pos = torch.zeros(batch, dtype=torch.long, device=model.device)
        self._positions: torch.Tensor | None = None
        self._row = 0
        self._first_row = 0
        self._prompt_valid: torch.Tensor | None = None
        # {window: (mask, causal)} of the prompt, made when a layer with that window first attends, from
        # the prompt's (valid, positions)
        self._prompt_masks: dict = {}
        self._mask_of = None
        self._phase = ""
        self._cached = 0  # tokens of the prompt being prefilled that the store held already (a prefix cache)
        self._plans: dict = {}  # layer -> this step's selection, asked one layer ahead
        self._row_buffers = _Stack()  # the rows `_attend_selected` gathers, reused by every layer
        # False: a selection takes the reference path (`_read_slots`: per KV head, padded to the largest
        # count), which tests and the benchmark compare the packed rows against
        self.read_rows = True
        self.state = self.policy.begin(model, self)

    # ---- the cursor, read ------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self._next_pos.shape[0]

    @property
    def positions(self) -> torch.Tensor | None:
        """[B, T] positions of the tokens being processed."""
        return self._positions

    @property
    def row(self) -> int:
        """Which of those tokens the current decoding row is."""
        return self._row

    @property
    def first_row(self) -> int:
        """The first decoding row in teacher-forced scoring."""
        return self._first_row

    @property
    def next_pos(self) -> torch.Tensor:
        """[B] position of each row's next token (during a step: of the current one)."""
        return self._next_pos

    @property
    def prompt_valid(self) -> torch.Tensor | None:
        """[B, T] real (unpadded) tokens of the prompt."""
        return self._prompt_valid

    @property
    def phase(self) -> str:
        """"prefill", "decode" (one token per row: placement prefetches), "replay" (several tokens per row
        decoded in turn) or "teacher" (teacher-forced scoring); "" before the first pass."""
        return self._phase

    @property
    def decoding(self) -> bool:
        return self._phase == "decode"

    # ---- the cursor, moved -----------------------------------------------------------------------------------
    def begin_prefill(self, positions: torch.Tensor, valid: torch.Tensor, cached: int = 0) -> None:
        """A prompt with positions [B, T] and real (unpadded) tokens valid [B, T] is about to be written;
        `cached` > 0: it continues the first `cached` tokens, whose keys and values the store holds already."""
        self._cached = cached
        self._positions, self._row, self._phase = positions, positions.shape[1] - 1, "prefill"
        self._next_pos = positions[:, -1] + 1
        self._prompt_valid = valid
        self._prompt_masks, self._mask_of = {}, (valid, positions)
        self._plans.clear()

    def begin_teacher(self, positions: torch.Tensor, first_row: int) -> None:
        """Teacher-forced scoring of unpadded rows at positions [B, T]: tokens before `first_row` are the prompt."""
        b, t = positions.shape
        self.begin_prefill(positions, torch.ones(b, t, dtype=torch.bool, device=positions.device))
        self._first_row, self._phase = first_row, "teacher"
        self._next_pos = torch.full((b,), t, dtype=torch.long, device=positions.device)
        self._mask_of = (torch.ones(1, first_row, dtype=torch.bool, device=positions.device), positions[:1, :first_row])

    def begin_step(self, positions: torch.Tensor | None = None) -> None:
        """A decoding step: one token per row at positions [B, 1] (default: each row's next position), or
        several per row decoded in turn ([B, T], e.g. a continuation fed to `infinigen.hf` at once)."""
        positions = self._next_pos[:, None] if positions is None else positions
        self._positions, self._row = positions, 0
        self._phase = "decode" if positions.shape[1] == 1 else "replay"
        self._next_pos = positions[:, 0]
        self._plans.clear()

    def move_to_row(self, row: int) -> None:
        """The next attention is for token `row` of the step."""
        self._row = row

    def end_step(self) -> None:
        self._next_pos = self._positions[:, -1] + 1

    # ---- what flows through ----------------------------------------------------------------------------------
    def event(self, layer: int, point: str, x: torch.Tensor) -> None:
        """A layer's hidden state at `point` ("attn_in", "attn_out"; layer -1 "embed" when a decoding step
        starts) is ready: the policy sees it (speculation), then the listeners, then placement may start
        moving what layer+1 will read (the policy may have just decided it)."""
        self.policy.on_hidden(layer, point, x, self)
        for lis in self.listeners:
            lis.on_hidden(layer, point, x, self)
        self.store.ahead(layer, point, self)

    def restore_prefix(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Put a cached prompt prefix's keys and values (per layer, [B, Hkv, n, d]) in the empty store's
        first slots; a `prefill_in_slices(..., cached=n)` of the rest of the prompt follows."""
        n = keys[0].shape[2]
        b = keys[0].shape[0]
        valid = torch.ones(b, n, dtype=torch.bool, device=keys[0].device)
        positions = torch.arange(n, device=keys[0].device).expand(b, n)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.store.write_prompt(layer, k, v, valid, positions)

    def prefill_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """What a prefill does to a session at `layer`, given the prompt's queries and keys/values: write
        them to the store, then let the policy and the listeners see them. Live prefills and replays
        (a shared prefill, `infinigen.eval.fanout`, the benchmark's) alike go through here."""
        t = k.shape[2]
        self.store.write_prompt(layer, k, v, self._prompt_valid[:, :t], self._positions[:, :t])
        self.policy.on_prefill(layer, q, k, v, self)
        for lis in self.listeners:
            lis.on_prefill(layer, q, k, v, self)

    def planned(self, layer: int) -> torch.Tensor | All | None:
        """What `layer` reads at this decoding step if it is known before its query: ALL, or a bool mask
        [B, Hkv, S] over the store's used slots; None while unknown. Placement fetches it one layer ahead;
        the layer then reads exactly this."""
        plan = self._plans.get(layer)
        if plan is not None:
            return plan
        pol = self.policy
        if not self.selects(layer):
            plan = ALL
        elif not pol.known_ahead(layer, self):
            return None
        else:
            _, _, valid, pos = self.store.past(layer)
            plan = self._one_row(pol.keep(layer, self._rows(valid, pos), self))
        self._plans[layer] = plan
        return plan

    def selects(self, layer: int) -> bool:
        """Whether the policy chooses what `layer` reads. A local layer of a model that mixes local and
        global layers (Gemma 3) reads its whole window: the window already bounds it, and the policy
        selects only on the global layers."""
        return self.policy.speculated(layer) and not self.model.cfg.local(layer)

    def replays(self) -> bool:
        """Whether teacher-forced scoring replays decoding row by row: the policy's state changes every step,
        a pool limit picks victims every step, or a listener wants every row."""
        return (self.policy.replays or self.store.allocator is not None
                or any(lis.per_row for lis in self.listeners))

    # ---- attention -------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of `layer` in the current pass: q [B,H,T,d] (post-RoPE, unscaled), k, v [B,Hkv,T,d] of
        the pass's tokens -> [B,H,T,d]. The prompt densely (its keys and values go to the store), a
        decoding step as the policy selects, teacher-forced rows as decoding would."""
        phase = self._phase
        if phase == "decode":
            return self._step_attention(layer, q, k, v)
        if phase == "prefill":
            return self._prompt_attention(layer, q, k, v)
        if phase == "teacher":
            return self._teacher_attention(layer, q, k, v)
        if phase == "replay":
            out = torch.empty_like(q)
            for r in range(q.shape[2]):
                self._row = r
                out[:, :, r:r + 1] = self._step_attention(layer, q[:, :, r:r + 1], k[:, :, r:r + 1], v[:, :, r:r + 1])
            return out
        raise RuntimeError("no pass has begun on this session (begin_prefill, begin_teacher or begin_step)")

    def _prompt_attention(self, layer, q, k, v) -> torch.Tensor:
        """Dense attention of the prompt; its keys and values go to the session first."""
        if self._cached:
            return self._continued_prompt_attention(layer, q, k, v)
        self.prefill_layer(layer, q, k, v)
        window = self.model.cfg.window(layer)
        if window not in self._prompt_masks:
            self._prompt_masks[window] = self.model.prompt_mask(*self._mask_of, window)
        mask, causal = self._prompt_masks[window]
        return self.model.dense_attention(q, k, v, mask, causal=causal)

    def _continued_prompt_attention(self, layer, q, k, v) -> torch.Tensor:
        """The rest of a prompt whose first `cached` tokens the store holds: its keys and values are written
        after them, the policy and listeners see the whole prompt's keys and values (a policy that
        `continues_prefill` builds from them what a prefill of the whole prompt builds), and its rows attend
        densely and causally over the whole prompt."""
        n, t = self._cached, k.shape[2]
        store = self.store
        store.write_prompt(layer, k, v, self._prompt_valid[:, :t], self._positions[:, :t], at=n)
        kp, vp, _, pos = store.past(layer)
        self.policy.on_prefill(layer, q, kp, vp, self)
        for lis in self.listeners:
            lis.on_prefill(layer, q, kp, vp, self)
        q_pos = self._positions[:, None, :, None]  # [B, 1, T, 1]
        mask = pos[:, :1, None, :] <= q_pos  # [B, 1, T, n + T]: causal over the whole prompt
        window = self.model.window(q_pos, pos[:, :1, None, :], layer)
        if window is not None:
            mask = mask & window
        return self.model.dense_attention(q, kp, vp, mask)

    def _rows(self, valid, pos, q=None, k=None, keys=None, packs: bool = False) -> Rows:
        """The current decoding row against the store's used slots."""
        r = self._row
        return Rows(first=r, positions=self._positions[:, r:r + 1], entry_pos=pos, valid=valid[:, :, None],
                    in_store=True, query=q, own_keys=k, keys=keys, packs=packs)

    @staticmethod
    def _one_row(keep):
        return keep if keep is ALL else keep[:, :, 0]

    def _read(self, layer: int, q, k, in_place: bool) -> _Read:
        """The selection of the current row at `layer` and, unless the store may be read in place by one
        fused call (`in_place` allows it), the keys and values it reads."""
        store, pol, model = self.store, self.policy, self.model
        kp, _, valid, pos = store.past(layer)
        cur = self._positions[:, self._row]  # [B]
        window = model.cfg.window(layer)
        rows = packed = None
        keep = self._plans.pop(layer, None)
        if keep is None:
            if self.selects(layer):
                # every used slot a visible candidate, read as packed rows: the policy may pack them itself
                packs = in_place and self.reads_rows() and window is None and not store.padded
                rows = self._rows(valid, pos, q, k, kp, packs)
                keep = pol.keep(layer, rows, self)
                if isinstance(keep, SelectedRows):
                    packed, keep = keep, keep.keep
                else:
                    keep = self._one_row(keep)
            else:
                keep = ALL
        if self.listeners:
            rows = rows or self._rows(valid, pos, q, k, kp)
            wide = keep if keep is ALL else keep[:, :, None]
            for lis in self.listeners:
                lis.on_select(layer, rows, wide, self)
        if keep is ALL:
            self.stats.record_rows(layer, valid.numel())  # every used slot of every (batch row, KV head)
            if in_place and store.attends_in_place() and not pol.needs_weights and (
                    window is None or store.length[layer] < window):
                # every used slot is valid and within the window, each a past token: every row reads all its
                # past (counted without tensor work: this is the dense step's per-layer path)
                self.stats.record_all(layer, *valid.shape)
                return _Read(cur, ALL, valid, None, None, None, ALL, True)
        visible = valid if window is None else valid & (cur[:, None, None] - pos < window)
        past = cur[:, None, None] if window is None else cur[:, None, None].clamp(max=window - 1)
        if keep is ALL:
            self.stats.record(layer, visible.sum(-1, keepdim=True), past)
            return self._read_dense(layer, _Read(cur, ALL, visible, None, None, None, ALL, False))
        if in_place and self.reads_rows():
            # the rows are read by the attention itself
            sel = packed if packed is not None else store.select_rows(layer, keep, visible)
            self.stats.record(layer, sel.counts[..., None], past)
            return _Read(cur, sel.keep, sel.keep, None, None, None, None, False, sel)
        return self._read_slots(layer, cur, keep, visible, past)

    def _read_slots(self, layer: int, cur, keep, visible, past) -> _Read:
        """The reference read of a selection: each (batch row, KV head) its slots, padded to the largest
        count (`KVStore.slots`), gathered into keys and values."""
        store = self.store
        keep, idx, mask, counts = store.slots(layer, keep, visible)  # an offloaded store planned them already
        kp, vp = store.gather(layer, idx)
        if past is not None:
            self.stats.record(layer, counts[..., None], past)
        self.stats.record_rows(layer, idx.numel())
        return _Read(cur, keep, keep, kp, vp, mask, idx, False)

    def reads_rows(self) -> bool:
        """Whether a decoding selection is read as packed rows (`KVStore.select_rows`, `_attend_selected`):
        the store allows it and the policy needs no weights (`observe` takes them per padded slot)."""
        return self.read_rows and self.store.reads_rows() and not self.policy.needs_weights

    def _attend_selected(self, layer: int, read: _Read, q, k, v) -> torch.Tensor:
        """Attention of one token per row over its packed selected rows (`read.rows`) and itself: the token is
        stored first and read among the rows; one masked fused call, each query head over its KV head's rows."""
        store = self.store
        slots = store.append(layer, k, v, read.cur)
        keys, values = store.k[layer], store.v[layer]
        if fused_select.usable(q, keys):  # the same attention in one C++ call, reading the store in place
            b, h, _, d = q.shape
            hkv = k.shape[1]
            own = torch.arange(b * hkv, device=q.device).view(b, hkv) * store.capacity + slots
            out, lse, read_sum = fused_select.attend_rows(q.view(b, h, d), keys.view(-1, d), values.view(-1, d),
                                                          read.rows.rows, read.rows.counts, own, self.model.scale)
            self.stats.record_rows(layer, read.rows.rows.numel())
            out = out.view(b, h, 1, d)
            rest = self.policy.unread(layer, self)
            if rest is not None:  # before the token's append: it was read
                out = _with_remainder(out, lse.view(b, hkv, h // hkv, 1), rest.lse, (rest.sums - read_sum)[:, :, None],
                                      (rest.counts - read.rows.counts)[:, :, None])
            self._appended(layer, slots, k, v)
            return out
        rows, head = _with_own(read.rows, slots, store.capacity)
        kp, vp = store.gather_rows(layer, rows, *self._row_buffers.rows(rows.numel(), k))
        self.stats.record_rows(layer, read.rows.rows.numel())
        out = attend_masked(q, kp, vp, _head_mask(head, q.shape[1], k.shape[1]), self.model.scale)
        rest = self.policy.unread(layer, self)
        if rest is not None:  # before the token's append: it was read
            out = _plus_unread_rows(out, rest, q, kp, vp, head, k.shape[1], self.model.scale)
        self._appended(layer, slots, k, v)
        return out

    def _read_dense(self, layer: int, read: _Read) -> _Read:
        """Every used slot, where attention can read it (an offloaded store hands its fast-tier copy)."""
        kp, vp = self.store.dense(layer)
        full = not self.store.padded and self.model.cfg.window(layer) is None
        return read._replace(keys=kp, values=vp, mask=read.seen, full=full)

    def _write(self, layer: int, read: _Read, probs, k, v) -> None:
        """After the row's attention: the policy sees the weights (if it asked), the token is stored."""
        store = self.store
        if self.policy.needs_weights:
            self.policy.observe(layer, probs, read.idx, self)
        slots = store.append(layer, k, v, read.cur)
        if store.allocator is not None:
            store.allocator.on_read(layer, read.seen)
        self._appended(layer, slots, k, v)

    def _appended(self, layer, slots, k, v) -> None:
        self.policy.on_append(layer, slots, k, v, self)
        for lis in self.listeners:
            lis.on_append(layer, slots, k, v, self)

    def _step_attention(self, layer: int, q, k, v) -> torch.Tensor:
        """Attention of one token per row (q [B,H,1,d]) over the past entries the policy keeps plus itself,
        then the token is stored. A plain dense step stores the token first and runs one fused attention
        over the store; otherwise the current token is kept apart, so nothing is copied."""
        read = self._read(layer, q, k, in_place=True)
        if read.rows is not None:
            return self._attend_selected(layer, read, q, k, v)
        if read.keys is None:
            slots = self.store.append(layer, k, v, read.cur)
            kp, vp = self.store.used_keys_values(layer)
            out = attend_all(q, kp, vp, self.model.scale)
            self._appended(layer, slots, k, v)
            return out
        out, probs = attend_step(q, read.keys, read.values, read.mask, k, v, self.model.scale)
        rest = self.policy.unread(layer, self)
        if rest is not None:  # before the token's append: it was read
            out = _plus_unread(out, rest, q, read.keys, read.mask[:, :, None], self.model.scale, k,
                               *_read_sums(read.values, read.mask))
        self._write(layer, read, probs, k, v)
        return out

    def _teacher_attention(self, layer: int, q, k, v) -> torch.Tensor:
        """The prompt rows densely (as `prefill`), then every later row as decoding would attend: all rows
        at once from the policy's `keep`, or replayed row by row (`replays`)."""
        p, t = self._first_row, q.shape[2]
        out = torch.empty_like(q)
        self._row = p - 1
        out[:, :, :p] = self._prompt_attention(layer, q[:, :, :p], k[:, :, :p], v[:, :, :p])
        if p == t:
            return out
        if self.replays():
            for r in range(p, t):
                self._row = r
                out[:, :, r:r + 1] = self._step_attention(layer, q[:, :, r:r + 1], k[:, :, r:r + 1], v[:, :, r:r + 1])
            return out
        b, hkv = k.shape[:2]
        dev = q.device
        row_pos = torch.arange(p, t, device=dev)[:, None]
        cols = torch.arange(t, device=dev)[None, :]
        before = cols < row_pos  # [R, T]
        rows = Rows(first=p, positions=self._positions[:, p:], entry_pos=cols[None], valid=before[None, None],
                    in_store=False, query=q[:, :, p:], own_keys=k[:, :, p:], keys=k)
        keep = self.policy.keep(layer, rows, self) if self.selects(layer) else ALL
        for lis in self.listeners:
            lis.on_select(layer, rows, keep, self)
        visible = before
        window = self.model.window(row_pos, cols, layer)
        past = row_pos.T
        if window is not None:
            visible = visible & window
            past = past.clamp(max=self.model.cfg.window(layer) - 1)  # a windowed layer's full cache: its window
        keep = visible[None, None] if keep is ALL else keep & visible
        self.stats.record(layer, keep.sum(-1).expand(b, hkv, t - p), past.expand(b, 1, t - p))
        rest = self.policy.unread(layer, self)
        out[:, :, p:] = attend_rows(q[:, :, p:], k, v, keep, p, self.store.codec, self.model.scale, rest)
        return out


class _Stack:
    """The padded buffers one decoding step stacks every session's entries into, allocated once per step at
    the longest read so far and reused by every layer (each layer's attention is done with them before the
    next layer writes; a large allocation per layer costs page faults on a CPU). Allocated as zeros: a
    padded entry then always holds a finite number (zero, or an earlier layer's key or value), which its
    weight of exactly 0 cancels."""

    def __init__(self):
        self.keys = self.values = None
        self.flat_keys = self.flat_values = None

    def rows(self, n: int, like: torch.Tensor):
        """Flat buffers [n, d] for the rows a packed selection gathers (`KVStore.gather_rows`)."""
        if self.flat_keys is None or self.flat_keys.shape[0] < n:
            cap = max(n, int(1.25 * self.flat_keys.shape[0]) if self.flat_keys is not None else n)
            self.flat_keys = like.new_empty(cap, like.shape[-1])
            self.flat_values = like.new_empty(cap, like.shape[-1])
        return self.flat_keys[:n], self.flat_values[:n]

    def views(self, rows: int, hkv: int, n: int, like: torch.Tensor):
        if self.keys is None or self.keys.shape[2] < n:
            cap = max(n, int(1.25 * self.keys.shape[2]) if self.keys is not None else n)
            self.keys = like.new_zeros(rows, hkv, cap, like.shape[3])
            self.values = like.new_zeros(rows, hkv, cap, like.shape[3])
        return self.keys[:, :, :n], self.values[:, :, :n]


def _with_own(sel: SelectedRows, slots: torch.Tensor, capacity: int):
    """A packed selection's rows and KV heads [B, n + Hkv] with each row's own token (stored in slots [B, Hkv])
    after them, one row per KV head."""
    b, hkv = slots.shape
    seg = torch.arange(b * hkv, device=slots.device).view(b, hkv)
    own = seg * capacity + slots
    return torch.cat([sel.rows, own], 1), torch.cat([sel.head, seg - seg[:, :1]], 1)


def _read_sums(values, mask):
    """The sum [B, Hkv, d] (float32) and count [B, Hkv] of the values [B, Hkv, n, d] read where mask [B, Hkv, n]."""
    return values.float().masked_fill(~mask[..., None], 0).sum(2), mask.sum(-1)


def _head_mask(head: torch.Tensor, h: int, hkv: int) -> torch.Tensor:
    """[B, 1, H, m]: query head j reads the columns of its KV head j // (H / Hkv) (`head` [B, m], -1 on
    padding)."""
    group = torch.arange(h, device=head.device) // (h // hkv)
    return head[:, None, None, :] == group[None, None, :, None]


def _attend_sessions_rows(layer: int, q, k, v, sessions, spans, reads, scale: float, stack: _Stack):
    """`_attend_sessions` when every session reads packed rows: each stores its token, its rows (padded to the
    longest session's) are gathered into one buffer, one masked fused call runs over every row."""
    stored = []
    for s, r, (a, b) in zip(sessions, reads, spans):
        slots = s.store.append(layer, k[a:b], v[a:b], r.cur)
        stored.append((slots, *_with_own(r.rows, slots, s.store.capacity)))
    m = max(rows.shape[1] for _, rows, _ in stored)
    kp, vp = stack.rows(q.shape[0] * m, k)
    kp, vp = kp.view(q.shape[0], m, -1), vp.view(q.shape[0], m, -1)
    head = torch.full((q.shape[0], m), -1, dtype=torch.long, device=q.device)
    for s, r, (slots, rows, own_head), (a, b) in zip(sessions, reads, stored, spans):
        pad = m - rows.shape[1]
        head[a:b, pad:] = own_head  # padding first, then the rows and the own tokens
        rows = F.pad(rows, (pad, 0))
        s.store.gather_rows(layer, rows, kp[a:b].view(-1, kp.shape[-1]), vp[a:b].view(-1, vp.shape[-1]))
        if r.idx is not ALL:  # a read of ALL counted its rows already (`_read`)
            s.stats.record_rows(layer, rows.numel() - slots.numel())
    out = attend_masked(q, kp[:, None], vp[:, None], _head_mask(head, q.shape[1], k.shape[1]), scale)
    for s, (slots, _, _), (a, b) in zip(sessions, stored, spans):
        rest = s.policy.unread(layer, s)
        if rest is not None:
            out[a:b] = _plus_unread_rows(out[a:b], rest, q[a:b], kp[a:b, None], vp[a:b, None], head[a:b],
                                         k.shape[1], scale)
        s._appended(layer, slots, k[a:b], v[a:b])
    return out


def _attend_sessions(layer: int, q, k, v, sessions: list[Session], spans: list[tuple[int, int]], scale: float,
                     stack: _Stack):
    """One decoding step's attention at `layer` for several sessions whose rows are stacked in q, k, v
    (session i owns rows spans[i]): each session selects from its own store, then one batched attention
    runs over every row, each row's entries padded to the longest read, and each session stores its token.

    When every session reads all its entries and none wants the weights (a dense step), each row's own token
    follows its entries, as in the store of a session decoded alone (a store read in place gets the token
    first and is copied with it), and one fused call runs; otherwise the current tokens stay apart
    (`attend_step`) and the sessions see the weights of what they read."""
    reads = [s._read(layer, q[a:b], k[a:b], in_place=True) for s, (a, b) in zip(sessions, spans)]
    if any(r.rows is not None for r in reads):
        if all(s.reads_rows() for s in sessions):  # a session reading all its entries reads them as rows
            reads = [r if r.rows is not None else r._replace(rows=s.store.select_rows(layer, r.seen, r.seen))
                     for s, r in zip(sessions, reads)]
            return _attend_sessions_rows(layer, q, k, v, sessions, spans, reads, scale, stack)
        # another session needs the reference path (weights, an offloaded store): every selection takes it
        reads = [r if r.rows is None else s._read_slots(layer, r.cur, r.keep, r.keep, None)
                 for s, r in zip(sessions, reads)]
    fused = all(r.idx is ALL and not s.policy.needs_weights for s, r in zip(sessions, reads))
    if not fused:  # a store that could have been read in place hands its entries like any other
        reads = [r if r.keys is not None else s._read_dense(layer, r) for s, r in zip(sessions, reads)]
    slots = [None] * len(sessions)
    entries = []  # per session: keys and values [B, Hkv, m, d] to stack, the current token among them if fused
    for i, (s, r, (a, b)) in enumerate(zip(sessions, reads, spans)):
        if r.keys is None:  # the token first, then the store's used slots, as `attend_all` reads them
            slots[i] = s.store.append(layer, k[a:b], v[a:b], r.cur)
            entries.append(s.store.past(layer)[:2])
        else:
            entries.append((r.keys, r.values))
    sizes = [e[0].shape[2] + (fused and r.keys is not None) for e, r in zip(entries, reads)]
    n = max(sizes)
    kp, vp = stack.views(q.shape[0], k.shape[1], n, k)
    length = torch.tensor([m for m, (a, b) in zip(sizes, spans) for _ in range(a, b)], device=q.device)
    mask = torch.arange(n, device=q.device) < length[:, None, None]  # [rows, 1, n]: each row's own entries
    mask = mask.expand(q.shape[0], k.shape[1], n)
    if not all(r.keys is None or r.full for r in reads):  # padding, a window or a selection somewhere
        mask = mask.contiguous()
    for (ks, vs), r, (a, b) in zip(entries, reads, spans):
        m = ks.shape[2]
        kp[a:b, :, :m], vp[a:b, :, :m] = ks, vs
        if r.keys is not None:
            if not r.full:  # not every entry of the session counts
                mask[a:b, :, :m] = r.mask
            if fused:
                kp[a:b, :, m:m + 1], vp[a:b, :, m:m + 1] = k[a:b], v[a:b]
    if fused:
        out = attend_masked(q, kp, vp, mask, scale)
        for s, r, slot, (a, b) in zip(sessions, reads, slots, spans):
            if slot is None:
                s._write(layer, r, None, k[a:b], v[a:b])
            else:
                s._appended(layer, slot, k[a:b], v[a:b])
        return out
    out, probs = attend_step(q, kp, vp, mask, k, v, scale)
    for s, r, m, (a, b) in zip(sessions, reads, sizes, spans):
        rest = s.policy.unread(layer, s)
        if rest is not None:
            out[a:b] = _plus_unread(out[a:b], rest, q[a:b], kp[a:b], mask[a:b, :, None], scale, k[a:b],
                                    *_read_sums(vp[a:b], mask[a:b]))
        p = probs[a:b]
        if s.policy.needs_weights and m < n:  # the session's own entries, then the current token
            p = torch.cat([p[..., :m], p[..., -1:]], dim=-1)
        s._write(layer, r, p, k[a:b], v[a:b])
    return out


# ---- the three passes --------------------------------------------------------------------------------------------
def prefill(model, tokens: torch.Tensor, session: Session, pad_mask: torch.Tensor | None = None,
            all_logits: bool = False) -> torch.Tensor:
    """tokens [B, T] left-padded (pad_mask True on real tokens). Returns logits of the last position
    [B, V], or of every position [B, T, V]."""
    slices = prefill_in_slices(model, tokens, session, pad_mask, all_logits, layers_per_slice=0)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def prefill_in_slices(model, tokens: torch.Tensor, session: Session, pad_mask: torch.Tensor | None = None,
                      all_logits: bool = False, layers_per_slice: int = 1, cached: int = 0):
    """`prefill` as a generator that pauses (yields) after every `layers_per_slice` layers (0: never), so a
    server can decode its running requests between slices while a long prompt joins. The logits are the
    generator's return value. Exactly `prefill`'s computation: a slice ends between two layers, and nothing
    another session does in between touches this session's cursor, store or policy state.

    `cached` > 0: the session's store holds the keys and values of the prompt's first `cached` tokens (a
    prefix cache restored them, `Session.restore_prefix`) and `tokens` are the rest (unpadded); only they
    are computed, attending to the whole prompt, for policies that `continues_prefill`."""
    if cached and (pad_mask is not None or not session.policy.continues_prefill()):
        raise ValueError("a prefill continues a cached prefix only unpadded, for a policy that continues_prefill")
    valid = torch.ones_like(tokens, dtype=torch.bool) if pad_mask is None else pad_mask.bool()
    positions = cached + (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding sits at position 0
    session.begin_prefill(positions, valid, cached)
    h = model.embed(tokens, positions)
    rope = model.rope(positions)
    for i, block in enumerate(model.layers):
        h = block(h, rope, session.attend, session.event)
        if layers_per_slice and (i + 1) % layers_per_slice == 0 and i + 1 < len(model.layers):
            yield i + 1  # layers done
    return model.head(h if all_logits else h[:, -1])


@torch.inference_mode()
def decode(model, tokens: torch.Tensor, sessions: Session | Sequence[Session],
           batch_invariant: bool = False) -> torch.Tensor:
    """One new token per row. One session: tokens [B], logits [B, V]. Several (the server's running
    requests, the sessions of a fan-out): tokens [sum of their B] in the sessions' order, logits likewise;
    everything per token runs on the stacked rows, each session selects from its own store, and each
    layer's attention is one call over every row, each row's entries padded to the longest read: a
    session's logits are those it gets decoded alone up to rounding (the padding moves its entries within
    the fused call's reductions, and the compiled step's kernels are chosen per padded batch size, which
    shows in bfloat16). `batch_invariant`: each session's attention is instead the very call it makes
    decoded alone (`Session.attend` on its rows) and the dense work runs eagerly (a row's arithmetic there
    does not depend on the rows beside it), so its logits are bit-identical to those alone whatever runs
    beside it, provided alone is decoded so too."""
    if isinstance(sessions, Session):
        return _decode_one(model, tokens, sessions, batch_invariant)
    sessions = list(sessions)
    if len(sessions) == 1:
        return _decode_one(model, tokens, sessions[0], batch_invariant)
    spans, at = [], 0
    for s in sessions:
        spans.append((at, at + s.batch))
        at += s.batch
        s.begin_step()
    positions = torch.cat([s.positions for s in sessions])  # [N, 1]: every row at its own position

    def event(layer, point, x):  # each session hears of its own rows
        for s, (a, b) in zip(sessions, spans):
            s.event(layer, point, x[a:b])

    stack = _Stack()

    def attend(layer, q, k, v):
        if batch_invariant:
            return torch.cat([s.attend(layer, q[a:b], k[a:b], v[a:b]) for s, (a, b) in zip(sessions, spans)])
        return _attend_sessions(layer, q, k, v, sessions, spans, model.scale, stack)

    h = model.embed(tokens[:, None], positions)
    event(-1, "embed", h)  # placement: layer 0's rows can start moving now
    logits = _blocks_and_head(model, h, model.rope(positions), attend, event, batch_invariant)
    for s in sessions:
        s.end_step()
    return logits


def _decode_one(model, tokens: torch.Tensor, session: Session, batch_invariant: bool = False) -> torch.Tensor:
    session.begin_step()
    positions = session.positions
    h = model.embed(tokens[:, None], positions)
    session.event(-1, "embed", h)  # placement: layer 0's rows can start moving now
    logits = _blocks_and_head(model, h, model.rope(positions), session.attend, session.event, batch_invariant, session)
    session.end_step()
    return logits


def _blocks_and_head(model, h, rope, attend, event, eager: bool = False,
                     session: Session | None = None) -> torch.Tensor:
    """A decoding step's blocks over h [B, 1, hidden] and the head: logits [B, V]. With a compiled step
    (`infinigen.compiled.enable`) and not `eager`, the dense work between two attentions is one compiled
    region, and one session's step may run whole (`StepParts.run`)."""
    if model.step_parts is not None and not eager:
        return model.step_parts.run(model, h, rope, attend, event, session)
    for block in model.layers:
        h = block(h, rope, attend, event)
    return model.head(h[:, -1])


@torch.inference_mode()
def teacher_forced(model, tokens: torch.Tensor, prefill_len: int, session: Session, head: bool = True) -> torch.Tensor:
    """Logits [B, T, V] for a whole sequence: the first `prefill_len` tokens as a prompt, every later
    position as if decoded one token at a time with the session's policy (same selections, same
    numbers up to float summation order). Rows must be unpadded. head=False: the hidden states the head
    would read [B, T, H] (every row's logits at once would be 17 GB at 32K tokens of a 262k vocabulary)."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    session.begin_teacher(positions, prefill_len)
    h = model.embed(tokens, positions)
    rope = model.rope(positions)
    for block in model.layers:
        h = block(h, rope, session.attend, session.event)
    return model.head(h) if head else h


__all__ = ["Session", "Listener", "KVStats", "prefill", "prefill_in_slices", "decode", "teacher_forced", "attend_all",
           "attend_masked", "attend_step", "attend_rows", "ALL", "Rows"]
