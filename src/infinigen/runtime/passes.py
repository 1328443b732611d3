"""The three passes a model runs over sessions: prefill, decode, teacher_forced."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from ..kernels.qlinear import dense_weights_kept, has_dense_linear, rows_as_alone
from ..model import rope_rows
from .attention import StepBuffers
from .session import Session
from .step_attention import attend_sessions, own_part


def prefill(model, tokens: torch.Tensor, session: Session, pad_mask: torch.Tensor | None = None,
            all_logits: bool = False, cached: int = 0, tile: int = 0) -> torch.Tensor:
    """tokens [B, T] left-padded (pad_mask True on real tokens). Returns logits of the last position
    [B, V], or of every position [B, T, V]. `cached`, `tile`: `prefill_in_slices`'."""
    slices = prefill_in_slices(model, tokens, session, pad_mask, all_logits, layers_per_slice=0, cached=cached,
                               tile=tile)
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


@torch.inference_mode()
def prefill_in_slices(model, tokens: torch.Tensor, session: Session, pad_mask: torch.Tensor | None = None,
                      all_logits: bool = False, layers_per_slice: int = 1, cached: int = 0, tile: int = 0):
    """`prefill` as a generator that pauses (yields) after every `layers_per_slice` layers (0: never), so a
    server can decode its running requests between slices while a long prompt joins. The logits are the
    generator's return value. Exactly `prefill`'s computation: a slice ends between two layers, and nothing
    another session does in between touches this session's cursor, store or policy state.

    `cached` > 0: the session's store holds the keys and values of the prompt's first `cached` tokens (a
    prefix cache restored them, `Session.restore_prefix`) and `tokens` are the rest (unpadded); only they
    are computed, attending to the whole prompt, for policies that `continues_prefill`.

    `tile` > 0 (unpadded, `cached` a multiple of it): every row's arithmetic is the same wherever the prompt was
    cut, so a prompt continued from a prefix cached at a multiple of `tile` gets the very bits of its whole
    prefill: the rows go through each layer's dense parts in tiles of `tile` rows at multiples of `tile`
    (`tiled_block`), and through its attention likewise (`Transformer.tiled_attention`). A matmul's and a flash
    call's blocking depend on their number of rows, which shows in bfloat16: without tiles a prefix hit's
    greedy answer can differ from a miss's."""
    if cached and (pad_mask is not None or not session.policy.continues_prefill()):
        raise ValueError("a prefill continues a cached prefix only unpadded, for a policy that continues_prefill")
    if tile and (pad_mask is not None or cached % tile):
        raise ValueError("a tiled prefill is unpadded and continues a prefix of whole tiles")
    valid = torch.ones_like(tokens, dtype=torch.bool) if pad_mask is None else pad_mask.bool()
    positions = cached + (valid.long().cumsum(-1) - 1).clamp(min=0)  # padding sits at position 0
    session.begin_prefill(positions, valid, cached, tile)
    h = model.embed(tokens, positions)
    rope = model.rope(positions)
    for i, block in enumerate(model.layers):
        h = tiled_block(block, h, rope, session, tile) if tile else block(h, rope, session.attend, session.event)
        if layers_per_slice and (i + 1) % layers_per_slice == 0 and i + 1 < len(model.layers):
            yield i + 1  # layers done
    return model.head(h if all_logits else h[:, -1])


def tiled_block(block, h: torch.Tensor, rope, session: Session, tile: int) -> torch.Tensor:
    """`block(h, rope, session.attend, session.event)` with its dense parts run on tiles of `tile` rows, each
    call's operands those of the same tile in any prefill that reaches it (`prefill_in_slices`' `tile`)."""
    spans = [(s, min(h.shape[1], s + tile)) for s in range(0, h.shape[1], tile)]
    rope = block.own_rope(rope)
    with dense_weights_kept():  # a quantized weight dequantized once for all the tiles, not once per tile
        parts = [block.attention_input(h[:, s:e], rope_rows(rope, s, e)) for s, e in spans]
        x, q, k, v = (torch.cat([p[0] for p in parts], 1), *(torch.cat([p[j] for p in parts], 2) for j in (1, 2, 3)))
        session.event(block.index, "attn_in", x)
        a = session.attend(block.index, q, k, v)
        h = torch.cat([block.attention_output(h[:, s:e], a[:, :, s:e]) for s, e in spans], 1)
        session.event(block.index, "attn_out", h)
        return torch.cat([block.feed_forward(h[:, s:e]) for s, e in spans], 1)


@torch.inference_mode()
def decode(model, tokens: torch.Tensor, sessions: Session | Sequence[Session],
           batch_invariant: bool = False, faults: dict[int, OSError] | None = None) -> torch.Tensor:
    """One new token per row. One session: tokens [B], logits [B, V]. Several (the server's running
    requests, the sessions of a fan-out): tokens [sum of their B] in the sessions' order, logits likewise;
    everything per token runs on the stacked rows, each session selects from its own store, and each
    layer's attention reads each session's packed rows by its own kernel call, or every row's entries in
    one call, each row's padded to the longest read (`step_attention.attend_sessions`): a session's logits
    are those it gets decoded alone up to rounding (the padding moves its entries within the fused call's
    reductions, and the compiled step's kernels are chosen per padded batch size, which shows in bfloat16).
    `batch_invariant`: each session's attention is instead the very call it makes decoded alone
    (`Session.attend` on its rows) and the dense work runs eagerly (a row's arithmetic there does not depend
    on the rows beside it), so its logits are bit-identical to those alone whatever runs beside it, provided
    alone is decoded so too.

    `faults` (a dict, several sessions): a session whose own work (its store's file reads and writes, on the
    store's worker or not) raises OSError leaves the step there instead of failing it: faults[i] = the error of
    session i, which hears nothing more of this step; its rows attend to nothing (zeros) and their logits mean
    nothing. With `batch_invariant` the other sessions' logits are unchanged (no row's arithmetic there depends on
    the rows beside it); decoded together they are those of the step without it up to rounding, where every
    session reads packed rows (`step_attention.attend_sessions`; elsewhere the error fails the step). Without
    `faults` the error fails the step."""
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
        for i, (s, (a, b)) in enumerate(zip(sessions, spans)):
            own_part(faults, i, s.event, layer, point, x[a:b])

    stack = StepBuffers()

    def attend(layer, q, k, v):
        if batch_invariant:
            outs = [own_part(faults, i, s.attend, layer, q[a:b], k[a:b], v[a:b])
                    for i, (s, (a, b)) in enumerate(zip(sessions, spans))]
            return torch.cat([torch.zeros_like(q[a:b]) if o is None else o for o, (a, b) in zip(outs, spans)])
        return attend_sessions(layer, q, k, v, sessions, spans, model.scale, stack, faults)

    h = model.embed(tokens[:, None], positions)
    event(-1, "embed", h)  # placement: layer 0's rows can start moving now
    logits = _blocks_and_head(model, h, model.rope(positions), attend, event, batch_invariant)
    for i, s in enumerate(sessions):
        if faults is None or i not in faults:
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
    # eager: batch-invariant, each row as alone
    with rows_as_alone(dense=has_dense_linear(model)) if eager else contextlib.nullcontext():
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

