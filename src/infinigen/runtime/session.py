"""A session: one batch of requests in flight, and the attention of each pass over it (`Session.attend`); the
listeners that hear what it computes."""
from __future__ import annotations

from typing import ClassVar, NamedTuple, Sequence

import torch

from ..cache import SelectedRows
from ..policy import FullCache, Policy
from ..selection import ALL, All, Rows
from . import attention
from .attention import StepBuffers
from .stats import KVStats
from .step_attention import attend_sessions


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


class ReadPlan(NamedTuple):
    """What one session's decoding row reads at a layer, before the attention runs (`Session._read`): for every
    batch row and KV head all of its entries read in place (the dense step), or the rows it reads packed per
    batch row (`rows`: a selection, or every visible entry of a padded, windowed or offloaded store).
    `step_attention.attend_sessions` consumes one per session."""
    cur: torch.Tensor  # [B] position of the row's token
    keep: torch.Tensor | All  # the selection (over the store's slots)
    seen: torch.Tensor  # [B, Hkv, S] the slots the selection read, for the pool's counters
    idx: All | None  # ALL: every used or visible slot; None: a selection
    rows: SelectedRows | None  # what is read, packed per batch row (`KVStore.select_rows`); None: every entry
    # in place


class StoreRows(Rows):
    """`Rows` of the current decoding row against a store's used slots whose keys, valid and entry positions are
    sliced from the store (`KVStore.past`) when a policy or listener first reads them: the fused selection reads
    none of them, so a selecting layer makes none of the slices."""

    def __init__(self, store, layer: int, first: int, positions: torch.Tensor, query=None, own_keys=None,
                 packs: bool = False):
        # (a frozen dataclass: its fields set at once through the instance's dict)
        self.__dict__.update(first=first, positions=positions, in_store=True, query=query, own_keys=own_keys,
                             packs=packs, _store=store, _layer=layer, _sliced=None)

    def _past(self) -> tuple:
        if self._sliced is None:
            keys, _, valid, pos = self._store.past(self._layer)
            object.__setattr__(self, "_sliced", (keys, valid[:, :, None], pos))
        return self._sliced

    @property
    def keys(self) -> torch.Tensor:
        return self._past()[0]

    @property
    def valid(self) -> torch.Tensor:
        return self._past()[1]

    @property
    def entry_pos(self) -> torch.Tensor:
        return self._past()[2]


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
        self._tile = 0  # a prefill's attention in tiles of this many rows (`Transformer.tiled_attention`); 0: not
        self._plans: dict = {}  # layer -> this step's selection, asked one layer ahead
        self._row_buffers = StepBuffers()  # the packed rows a step gathers, reused by every layer
        self._row_key: tuple = (None, -1)  # (positions, row) the tensors below were made for
        self._row_tensors: tuple = ()  # `_current_row`'s (cur, positions, past), made once per row
        self._layer_facts: dict = {}  # layer -> (its window, whether the policy selects it): the model's and the
        # policy's (a frozen record), so found once per session
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
    def begin_prefill(self, positions: torch.Tensor, valid: torch.Tensor, cached: int = 0, tile: int = 0) -> None:
        """A prompt with positions [B, T] and real (unpadded) tokens valid [B, T] is about to be written;
        `cached` > 0: it continues the first `cached` tokens, whose keys and values the store holds already;
        `tile` > 0: its attention in tiles (`Transformer.tiled_attention`, `runtime.prefill_in_slices`)."""
        self._cached, self._tile = cached, tile
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

    def restore_prefix(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], at: int = 0) -> None:
        """Put a cached prompt prefix's keys and values (per layer, [B, Hkv, n, d]) in the store's slots
        at..at+n-1 (`at` > 0: after the part of the prefix restored before, so a prefix can be restored a cached
        block at a time); a `prefill_in_slices(..., cached=...)` of the rest of the prompt follows."""
        n = keys[0].shape[2]
        b = keys[0].shape[0]
        valid = torch.ones(b, n, dtype=torch.bool, device=keys[0].device)
        positions = torch.arange(at, at + n, device=keys[0].device).expand(b, n)
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.store.write_prompt(layer, k, v, valid, positions, at=at)

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

    def fetch_plan(self, layer: int) -> torch.Tensor | All | None:
        """What placement fetches ahead for `layer` at this decoding step: its plan (`planned`), except that a
        layer reading every entry it sees behind a sliding window that hides some used slots (a local layer of
        Gemma 3 past its window) fetches only the visible slots [B, Hkv, S], the rows its attention packs."""
        plan = self.planned(layer)
        window = self.model.cfg.window(layer)
        store = self.store
        if plan is not ALL or window is None or (store.allocator is None and store.length[layer] < window):
            return plan  # (no victims and fewer slots than the window: every used slot is within it)
        _, _, valid, pos = store.past(layer)
        return self._visible(valid, pos, window)

    def _visible(self, valid: torch.Tensor, pos: torch.Tensor, window: int | None) -> torch.Tensor:
        """The used slots [B, Hkv, S] the current row sees: the valid ones within its window."""
        return valid if window is None else valid & (self._current_row()[0][:, None, None] - pos < window)

    def selects(self, layer: int) -> bool:
        """Whether the policy chooses what `layer` reads. A local layer of a model that mixes local and
        global layers (Gemma 3) reads its whole window: the window already bounds it, and the policy
        selects only on the global layers."""
        return self.policy.selects(layer) and not self.model.cfg.local(layer)

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
        if self._tile:
            return self.model.tiled_attention(q, k, v, 0, self._tile, layer)
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
        _, _, _, pos = store.past(layer)
        kp, vp = store.keys_values(layer, 0, n + t)
        self.policy.on_prefill(layer, q, kp, vp, self)
        for lis in self.listeners:
            lis.on_prefill(layer, q, kp, vp, self)
        if self._tile:
            return self.model.tiled_attention(q, kp, vp, n, self._tile, layer)
        q_pos = self._positions[:, None, :, None]  # [B, 1, T, 1]
        mask = pos[:, :1, None, :] <= q_pos  # [B, 1, T, n + T]: causal over the whole prompt
        window = self.model.window(q_pos, pos[:, :1, None, :], layer)
        if window is not None:
            mask = mask & window
        return self.model.dense_attention(q, kp, vp, mask)

    def _current_row(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The current decoding row's cur [B] (its tokens' positions), positions [B, 1] and past [B, 1, 1] (the
        tokens before it: a copy, which the counters keep), made once per row and shared by every layer: the
        same for each layer of a step."""
        positions, r = self._positions, self._row
        if self._row_key[0] is not positions or self._row_key[1] != r:
            cur = positions[:, r]
            self._row_tensors = (cur, positions[:, r:r + 1], cur[:, None, None].clone())
            self._row_key = (positions, r)
        return self._row_tensors

    def _rows(self, valid, pos, q=None, k=None, keys=None, packs: bool = False) -> Rows:
        """The current decoding row against the store's used slots."""
        return Rows(first=self._row, positions=self._current_row()[1], entry_pos=pos, valid=valid[:, :, None],
                    in_store=True, query=q, own_keys=k, keys=keys, packs=packs)

    @staticmethod
    def _one_row(keep):
        return keep if keep is ALL else keep[:, :, 0]

    def _read(self, layer: int, q, k) -> ReadPlan:
        """The read plan of the current row at `layer`: every used slot in place, or the rows it reads packed
        per batch row (a selection; every visible entry of a store not read in place)."""
        got = self._selection(layer, q, k, packs=True)
        if isinstance(got, ReadPlan):
            return got
        cur, keep, packed, valid, visible, past = got  # (valid and visible None with the policy's packed rows)
        store = self.store
        if keep is ALL:
            every = store.allocator is None and not store.padded and visible is valid  # (no count to wait on)
            sel = store.every_row(layer) if every else store.select_rows(layer, visible, valid)
            return ReadPlan(cur, ALL, visible, ALL, sel)
        sel = packed if packed is not None else store.select_rows(layer, keep, visible)
        self.stats.record(layer, sel.counts, past, owned=True)
        beside = self.policy.keys_beside(layer, self)
        if beside is not None:
            self.stats.record_keys(layer, beside.view(sel.counts.shape), past)
        return ReadPlan(cur, sel.keep, sel.keep, None, sel)

    def _selection(self, layer: int, q, k, packs: bool):
        """What the current row reads at `layer`, as the policy says it (asked now, or planned one layer ahead),
        listeners told and the reads counted: the plan of every used slot read in place where that is all it
        reads, else (cur [B], keep: ALL or [B, Hkv, S], the policy's own packed rows or None, the used slots'
        valid and visible [B, Hkv, S] (None with the policy's own packed rows), each row's past length for the
        counters). `packs`: the policy may answer with the rows packed (`Rows.packs`) where the store is read in
        place (the padded reference does not)."""
        store, pol, model = self.store, self.policy, self.model
        cur, positions, past = self._current_row()
        facts = self._layer_facts.get(layer)
        if facts is None:
            facts = self._layer_facts[layer] = (model.cfg.window(layer), self.selects(layer))
        window = facts[0]
        rows = packed = None
        keep = self._plans.pop(layer, None)
        if keep is not None and keep is not ALL and pol.reselects(layer, self):
            keep = None  # the plan was what placement prefetched: the layer's own query selects
        if keep is None:
            if facts[1]:
                # every used slot a visible candidate, read as packed rows in place, or handed by an offloaded
                # store to a layer whose own query selects now (again after a plan, or with nothing known ahead):
                # the policy may pack them itself (an offloaded store packs the plan it fetched one layer ahead)
                packs = (packs and window is None and not store.padded
                         and (store.reads_rows() or (store.offloaded and (pol.reselects(layer, self)
                                                                          or not pol.known_ahead(layer, self)))))
                rows = StoreRows(store, layer, self._row, positions, q, k, packs)
                keep = pol.keep(layer, rows, self)
                if isinstance(keep, SelectedRows):
                    packed, keep = keep, keep.keep
                else:
                    keep = self._one_row(keep)
            else:
                keep = ALL
        if self.listeners:
            rows = rows or StoreRows(store, layer, self._row, positions, q, k)
            wide = keep if keep is ALL else keep[:, :, None]
            for lis in self.listeners:
                lis.on_select(layer, rows, wide, self)
        if packed is not None:  # the policy's own packed rows: every used slot was a visible candidate
            return cur, keep, packed, None, None, past
        _, _, valid, pos = store.past(layer)
        if keep is ALL:
            self.stats.record_rows(layer, valid.numel())  # every used slot of every (batch row, KV head)
            if store.attends_in_place() and not pol.needs_weights and (window is None or store.length[layer] < window):
                # every used slot is valid and within the window, each a past token: every row reads all its
                # past (counted without tensor work: this is the dense step's per-layer path)
                self.stats.record_all(layer, *valid.shape)
                return ReadPlan(cur, ALL, valid, ALL, None)
        visible = self._visible(valid, pos, window)
        past = past if window is None else past.clamp(max=window - 1)  # (a copy either way)
        if keep is ALL:
            self.stats.record(layer, visible.sum(-1, keepdim=True), past, owned=True)
        return cur, keep, packed, valid, visible, past

    def _write(self, layer: int, read: ReadPlan, weights, k, v) -> None:
        """After the row's attention: the policy sees the weights (if it asked: `observed`), the token is
        stored."""
        store = self.store
        if self.policy.needs_weights:
            self.policy.observe(layer, *weights, self)
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
        with what the policy estimates the unread entries add, then the token is stored: the decoding step's
        one attention (`step_attention.attend_sessions`), this session its one member."""
        return attend_sessions(layer, q, k, v, [self], [(0, q.shape[0])], self.model.scale, self._row_buffers)

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
        beside = self.policy.keys_beside(layer, self) if self.selects(layer) else None
        if beside is not None:
            self.stats.record_keys(layer, beside, past.expand(b, 1, t - p))
        remainder = self.policy.remainder_at(layer, self)
        out[:, :, p:] = attention.attend_rows(q[:, :, p:], k, v, keep, p, self.store.codec, self.model.scale, remainder)
        return out

