"""What each compiled part of a decoding step computes (`infinigen.compiled` traces and compiles them): the dense
work between two attentions of a block, and, where a step runs whole, the token's append to its layer's pool and
its attention over the used slots."""
from __future__ import annotations

import torch
from torch import nn

from .kernels import int4_gemv


class Enter(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h, rope):
        return self.block.attention_input(h, rope)


class Between(nn.Module):
    """From `block`'s attention output a to the next block's attention: `block`'s residual after attention
    (the "attn_out" event's), its output, and the next block's attention input and q, k, v."""

    def __init__(self, block, nxt):
        super().__init__()
        self.block, self.nxt = block, nxt

    def forward(self, h, a, rope):
        h1 = self.block.attention_output(h, a)
        out = self.block.feed_forward(h1)
        return (h1, out, *self.nxt.attention_input(out, rope))


class Leave(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h, a):
        h1 = self.block.attention_output(h, a)
        return h1, self.block.feed_forward(h1)


def attend_pool(q, keys, values, scale: float):
    """One token per row, q [B,H,1,d], over the used slots of a layer's pool, keys and values [B,Hkv,L,d] (views
    of the store, the token's own written first; L is a symbolic size: one compiled kernel serves every cached
    length and every pool capacity). In float32 as pointwise products and reductions, which Inductor fuses
    into loops (no matmul call, no product kept); in bfloat16 on a CPU with AVX512-BF16 the native
    `infinigen::decode_attend` instead (the same float32 sums; Inductor's loops computed each score's lane sum
    alone, split the work by row and KV head only, which leaves one of two threads idle at batch 1, and ran the
    softmax on one thread)."""
    if int4_gemv.takes_attend(q, keys):
        return int4_gemv.decode_attend(q, keys, values, scale)
    b, h, _, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(b, hkv, h // hkv, 1, d).float()
    scores = (qg * keys[:, :, None].float()).sum(-1) * scale  # [B, Hkv, G, L]
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * values[:, :, None].float()).sum(-2)  # [B, Hkv, G, d]
    return out.to(q.dtype).reshape(b, h, 1, d)


def append_and_attend(q, k, v, keys, values, valid, pos, cur, slot, scale: float):
    """The token's k, v [B,Hkv,1,d] written at `slot` of a layer's whole pool, keys and values [B,Hkv,C,d] (with
    its valid mark and its position, cur [B], in valid and pos [B,Hkv,C]: what `KVStore.append` writes), then
    q's attention over slots 0..slot. The writes are in place on the store's tensors (Inductor stores the one
    slot; nothing else of the pool is copied); `slot` and the capacity C are symbols of the traced graph."""
    keys.narrow(2, slot, 1).copy_(k)
    values.narrow(2, slot, 1).copy_(v)
    valid.narrow(2, slot, 1).fill_(True)
    pos.narrow(2, slot, 1).copy_(cur[:, None, None].expand(valid.shape[0], valid.shape[1], 1))
    return attend_pool(q, keys.narrow(2, 0, slot + 1), values.narrow(2, 0, slot + 1), scale)


class AttendBetween(nn.Module):
    """`Between` with `block`'s token appended to its pool and its attention over the pool in front: from
    `block`'s q, k, v and its store's tensors to the next block's attention input."""

    def __init__(self, block, nxt, scale: float):
        super().__init__()
        self.block, self.nxt, self.scale = block, nxt, scale

    def forward(self, h, q, k, v, keys, values, valid, pos, cur, rope, slot):
        a = append_and_attend(q, k, v, keys, values, valid, pos, cur, slot, self.scale)
        h1 = self.block.attention_output(h, a)
        out = self.block.feed_forward(h1)
        return (h1, out, *self.nxt.attention_input(out, rope))


class AttendLeave(nn.Module):
    def __init__(self, block, scale: float):
        super().__init__()
        self.block, self.scale = block, scale

    def forward(self, h, q, k, v, keys, values, valid, pos, cur, slot):
        h1 = self.block.attention_output(h, append_and_attend(q, k, v, keys, values, valid, pos, cur, slot,
                                                               self.scale))
        return h1, self.block.feed_forward(h1)


# what each part is made from and how many tensor inputs come before its rotary ones
PARTS = {"enter": (Enter, 1), "between": (Between, 2), "leave": (Leave, 2),
             "attend_between": (AttendBetween, 9), "attend_leave": (AttendLeave, 9)}
ROTATES = ("enter", "between", "attend_between")  # the parts ending in the next layer's attention input
