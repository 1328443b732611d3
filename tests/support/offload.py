"""The offloading engine's tests' common parts: a run of the engine on a fixed batch of prompts (one of them
left-padded), the policies they run, a fixed-order allocator, and a counter of the bytes read from the slow
tier."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infinigen import runtime
from infinigen.policies import make_policy
from infinigen.policies.base import Policy

B, PROMPT, GEN = 3, 24, 10


class PlannedRandom(Policy):
    """A stateful selection known one layer ahead (like InfiniGen's): a random 40% of the entries, drawn
    once per layer and step, whenever the runtime asks. Exercises the prefetch path on its own."""
    name = "planned-random"
    needs_query = False
    replays = True  # a new draw every step

    def begin(self, model, session):
        super().begin(model, session)
        self.gen = torch.Generator().manual_seed(7)

    def keep(self, layer, rows, session):
        return (torch.rand(rows.valid.shape, generator=self.gen) < 0.4).to(rows.valid.device)


def offload_policy(name, model=None):
    """A policy by name: the registry's, "planned-random" (above), and "infinigen" with random orthogonal skew
    matrices and a dense layer 0."""
    if name == "planned-random":
        return PlannedRandom()
    if name == "infinigen":
        pytest.importorskip("infinigen.policies.infinigen")
        cfg = model.cfg  # random orthogonal skew matrices: no calibration needed, the maths is the same
        g = torch.Generator().manual_seed(5)
        a = torch.linalg.qr(torch.randn(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim, generator=g))[0]
        return make_policy("infinigen", dense_layers=(0,)).with_skew(a)
    return make_policy(name)


def offload_prompts(batch=B, length=PROMPT, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 256, (batch, length), generator=g)
    pad = torch.ones(batch, length, dtype=torch.bool)
    pad[0, :5] = False  # a shorter, left-padded row
    return tokens, pad


def run_placed(model, placement, policy, capacity=None, pool_bytes=None, allocator=None, gen=GEN, keep=False,
               prompts=None):
    """Greedy decoding of `gen` tokens after the prompts (`prompts`: (tokens, pad mask or None), else
    `offload_prompts()`), in a session of `placement`: (tokens [B, gen], the logits of each step [B, gen, V], the
    session), the session closed unless `keep`."""
    tokens, pad = prompts if prompts is not None else offload_prompts()
    tokens, pad = tokens.to(model.device), None if pad is None else pad.to(model.device)
    placement = dataclasses.replace(placement, capacity=capacity, pool_bytes=pool_bytes)
    sess = placement.new_session(model, tokens.shape[0], tokens.shape[1] + gen, policy, allocator=allocator)
    logits = runtime.prefill(model, tokens, sess, pad)
    out, steps = [], []
    for _ in range(gen):
        t = logits.argmax(-1)
        out.append(t)
        logits = runtime.decode(model, t, sess)
        steps.append(logits)
    result = torch.stack(out, 1), torch.stack(steps, 1), sess
    if not keep:
        placement.close(sess)
    return result


class SlowReads(TorchDispatchMode):
    """Bytes that aten ops read from the slow tier's tensors, whatever code path reads them: an
    index_select reads its rows of the pool, any other op (copy, clone, matmul, ...) every element of the
    pool view it is given. Views are no reads, nor are writes (in-place targets, out=). Dispatch modes
    are per thread: use it with an inline store (Placement(threaded=False))."""

    def __init__(self, store):
        super().__init__()
        self.pool = {t.untyped_storage().data_ptr() for t in store.tier.tensors}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        is_view = any(r.alias_info is not None for r in schema.returns) and not schema.is_mutable
        if not is_view:
            for i, a in enumerate(schema.arguments):
                x = args[i] if i < len(args) else kwargs.get(a.name)
                if not isinstance(x, torch.Tensor) or x.untyped_storage().data_ptr() not in self.pool:
                    continue
                if a.alias_info is not None and a.alias_info.is_write:
                    continue  # written, not read
                if func.overloadpacket is torch.ops.aten.index_select:
                    dim = args[1] if len(args) > 1 else kwargs["dim"]
                    index = args[2] if len(args) > 2 else kwargs["index"]
                    self.bytes += index.numel() * (x.numel() // x.shape[dim]) * x.element_size()
                else:
                    self.bytes += x.numel() * x.element_size()
        return func(*args, **kwargs)


def selective_policy(name, model):
    """Policies whose decode steps read a real subset (InfiniGen without its 32-token floor: the
    prompts here are shorter)."""
    if name == "infinigen":
        return make_policy("infinigen", preset="flat", dense_layers=(0,), min_fetch=0).with_skew(
            offload_policy("infinigen", model).matrices)
    if name == "infinigen-paper":
        mats = offload_policy("infinigen", model).matrices
        return make_policy("infinigen", preset="paper", dense_layers=(0,)).with_skew(mats)
    if name == "streaming":
        return make_policy("streaming", sinks=2, window=6)
    return offload_policy(name, model)


def corrected_policy(model, **knobs):
    """InfiniGen selecting a real subset of these short prompts (no 32-token floor, layer 0 dense), "auto" query
    and the remainder: own query in fast memory, speculation corrected by the own query when offloaded."""
    mats = offload_policy("infinigen", model).matrices
    knobs = dict(preset="flat", dense_layers=(0,), min_fetch=0, query="auto", remainder=True) | knobs
    return make_policy("infinigen", **knobs).with_skew(mats)


class FifoVictims:
    """A minimal allocator for the pool-limit test (oldest slot first), so this test does not depend on
    the pool manager's own policies; `infinigen.pool` is exercised when present (below)."""

    def begin(self, num_layers, batch, kv_heads, capacity, device):
        self.next = [0] * num_layers
        self.capacity = capacity

    def victims(self, layer, store):
        slot = self.next[layer]
        self.next[layer] = (slot + 1) % self.capacity
        b, h = store.valid[layer].shape[:2]
        return torch.full((b, h), slot, dtype=torch.long, device=store.valid[layer].device)

    def on_write(self, layer, slots):
        pass

    def on_read(self, layer, mask):
        pass
