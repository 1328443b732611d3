"""A compiled decoding step: the dense work between two attentions as one Inductor kernel per layer.

A decoding step is a few large operations (the weight matmuls, the attention) among hundreds of small ones
(norms, rotary, residuals, the MLP's activation, views). Run eagerly each small one is an operator call,
and at batch 1 their dispatch is a large part of a step on a CPU. Here the dense work of a step is cut
where the runtime's attention and events come in, into three parts:

    enter     layer 0's attention input and its q, k, v                         (`Block.attention_input`)
    between   layer i's residual after attention, its MLP, and layer i+1's      (`attention_output`,
              attention input and q, k, v                                        `feed_forward`, ...)
    leave     the last layer's residual after attention and its output

Each part is traced once to an aten graph with every weight an input (`make_fx` over `functional_call`),
and compiled by Inductor (`torch._inductor.compile`: fused C++ loops on a CPU, Triton on CUDA), so one
compiled kernel serves every layer and the compile time does not grow with depth. The compiled parts are
called directly with tensors: no Dynamo guards per call (they cost ~170 us a call here, more than the fused
kernels save, for a region taking two blocks' weights). What a part was traced for is its key: the block
structure (module types, weight shapes and dtypes), the dtype, the device and the batch size rounded up to a
power of two (rows are padded with zeros: a padded row is a zero vector, whose norm is finite), and the
inputs' sizes and strides, which Inductor's generated code checks. The dense parts' inputs are made
contiguous.

The whole step. Where one session's step reads every used slot of its store in place (`runs_whole`: the
full cache, or a policy reading densely this step such as InfiniGen below its crossing; a store in RAM with
every used slot valid, no policy wanting the weights, no sliding window, a power-of-two batch), each layer's
attention moves into the compiled region too, and a step is `enter` then one call per layer:

    attend_between   layer i's append and attention over its pool, then `between`
    attend_leave     the last layer's append and attention over its pool, then `leave`

Each takes the layer's store tensors whole (keys, values, valid, pos) and the slot the token goes to, writes the
token there in place, as `KVStore.append` would (Inductor stores the one slot), and attends over the slots before
it and its own (gpt-fast's static cache, written inside the graph; in bfloat16 on a CPU with AVX512-BF16 the
attention is the native `infinigen::decode_attend`, traced in like an aten op; the parts' modules are in
`compiled_parts`). The slot (passed as the size of a marker tensor, which Inductor's C++ wrapper takes too:
`_symbolic_slot`), the store's capacity, and q's, k's and v's batch and head strides are symbols of the traced
graph (`make_fx` in symbolic mode over fake inputs marked so, `_symbolic`): one compiled kernel per part serves
every cached length, every pool and every layer, so a run compiles nothing after `warm` (a server before it
listens, a benchmark before its timed steps). Outside the calls, per layer, only Python runs: the store's append
pointer (`KVStore.wrote_in_place`) and the session's bookkeeping as in its attention (`Session._read`'s plan,
listeners and counters; `on_append` for the policy and listeners; the events). Each layer's part is found by its
inputs' layouts in the first such step; the steps after it that are alike (the same store, layer 0's inputs of the
same layouts) make the same calls without looking them up again (`_WholePlan`). The generated code checks no
input's size or stride (`_OPTIONS`: ~26 Python calls a part): what a part is called with is what it was found and
compiled for.
The default: `--compile on` and `auto` run a step whole where it may, `parts` never.

What stays eager otherwise is what the runtime and the policies decide per step (the store, the selection,
the attention over a length that grows each step) and the head (its int8 table: Inductor's own code for it
was 2x slower than `_weight_int8pack_mm`). Prefill is not compiled: a few large matmuls over many rows,
where dispatch does not show.

Inductor keeps its artifacts in `TORCHINDUCTOR_CACHE_DIR` (default: the infinigen cache's `inductor/`),
so a later run compiles from its cache. If compiling fails (no C++ compiler, an operator Inductor cannot
take), the step warns once, in one line, and runs eagerly: the same computation, slower.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
import weakref

import torch
from torch import nn

from .compiled_parts import PARTS, ROTATES
from .paths import cache_dir
from .selection import ALL

MODES = ("auto", "on", "whole", "parts", "off")  # on = whole: a dense step runs whole (`runs_whole`); parts: never
MAX_BUCKET = 64  # decoding rows beyond this run eagerly (the weight kernels switch to dense matmuls there)
PLANS = 8  # stores whose whole step's calls are kept (`StepParts._whole_plan`)


# an attending part's inputs whose layout is symbolic: q, k, v (1, 2, 3; their batch and head strides: slices of
# the rotated q and k, or of the joined projections' output, as the part before it left it) and the store's
# tensors, keys, values, valid and pos (4..7: whole, contiguous, their capacity a symbol)
_POOLS = (4, 5, 6, 7)
_SYMBOLIC_STRIDES = {1: 3, 2: 3, 3: 3}  # input -> how many leading dimensions have a symbolic stride
_TRACE_SLOT, _TRACE_CAPACITY = 36, 53
_SLOT_MARGIN = 2  # a slot's marker tensor holds this many more elements than the slot (`_symbolic_slot`)
# Inductor's options for every part: no size and stride check of each input and each op's output per call (~26
# Python calls a part, 3% of a batch-1 step's CPU): a part is found by its inputs' layouts (`_seen`, the whole
# step's `_WholePlan`) and by its blocks' structure, weight strides included, so what it is called with is what it
# was compiled for
_OPTIONS = {"size_asserts": False}


def _weights(blocks: tuple) -> dict:
    """The blocks' weights by the names the part's wrapper gives them ("block.…", "nxt.…")."""
    return {f"{prefix}.{n}": t for prefix, b in zip(("block", "nxt"), blocks)
            for n, t in (*b.named_parameters(), *b.named_buffers())}


def _structure(block: nn.Module) -> tuple:
    """What a traced part depends on in a block: its modules' types and its tensors' names, shapes, strides and
    dtypes (a layer whose matrix fell back to int8 is another structure; the compiled code checks no input's
    layout, `_OPTIONS`, so a weight of other strides is another part too)."""
    return (tuple(type(m).__name__ for m in block.modules()),
            tuple((n, tuple(t.shape), _strides(t), t.dtype)
                  for n, t in (*block.named_parameters(), *block.named_buffers())))


def _strides(t: torch.Tensor) -> tuple:
    """The strides compiled code depends on: those of the dimensions of more than one element (a pool view
    of one batch row and one KV head is then the same input whatever the pool's capacity)."""
    return tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.stride()))


def _bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def _signature(t: torch.Tensor, position: int | None) -> tuple:
    """What a compiled part's code depends on in an input: its sizes, strides, dtype and device, but what is
    symbolic in an attending part's input at `position` (None: a dense part's input, nothing symbolic)."""
    if position in _POOLS:
        return tuple(n for i, n in enumerate(t.shape) if i != 2), t.is_contiguous(), t.dtype, t.device.type
    if position is None or position not in _SYMBOLIC_STRIDES:
        return tuple(t.shape), _strides(t), t.dtype, t.device.type
    return tuple(t.shape), t.stride()[_SYMBOLIC_STRIDES[position]:], t.dtype, t.device.type


def _symbolic(fake_mode, t: torch.Tensor, position: int | None):
    """`t` as a fake tensor of `fake_mode` for tracing: static but for what `_signature` leaves out, traced as
    symbols (a store's tensor is traced as one of `_TRACE_CAPACITY` slots)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    static, dynamic, infer = DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.INFER_STRIDE
    lead = _SYMBOLIC_STRIDES.get(position, 0) if position is not None else 0
    sizes = [static] * t.dim()
    if position in _POOLS:
        t = torch.zeros(*t.shape[:2], _TRACE_CAPACITY, *t.shape[3:], dtype=t.dtype, device=t.device)
        sizes[2] = dynamic
    elif lead:  # q, k, v [B, H, 1, d]: traced as views with strides unlike each other and unlike 0 or 1
        b, h, _, d = t.shape
        t = torch.zeros(b, 2, h + 5, d, dtype=t.dtype, device=t.device).transpose(1, 2)[:, :h, :1]
    return fake_mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=sizes, dynamic_strides=[dynamic] * lead + [infer] * (t.dim() - lead)))


def _symbolic_slot(fake_mode):
    """The slot an attending part writes the token at, traced as the size of a marker tensor less
    `_SLOT_MARGIN` (Inductor's C++ wrapper takes no integer symbol as an input, only tensors' sizes; the margin
    keeps the size above 1, which tracing would specialise for a slot of 0 or 1)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext
    marker = torch.empty(_TRACE_SLOT + _SLOT_MARGIN, dtype=torch.uint8)
    return fake_mode.from_tensor(marker, symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC], dynamic_strides=[DimDynamic.INFER_STRIDE]))


def available() -> str | None:
    """Why this machine cannot compile (None: it can): Inductor on a CPU needs a C++ compiler."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++) for torch.compile's CPU backend"
    return None


class StepParts:
    """The compiled parts of a decoding step (see the module docstring) and `run`, the blocks of a step.

    `compile_seconds`: the time spent tracing and compiling so far (reported by the commands), part by part
    in `compile_log`; `compiled`: how many parts were compiled; `failed`: the reason once compiling failed,
    after which the step runs eagerly (`Block.forward`)."""

    def __init__(self, whole: bool = True, cpp_wrapper: bool = False):
        self.whole = whole  # a session's step may run whole (`runs_whole`); False: the dense parts only
        self.cpp_wrapper = cpp_wrapper  # a CPU part's generated wrapper in C++ (`_compile`); False: Python's
        self.wrappers: dict = {}  # part name -> the wrapper its last compile got ("cpp" or "python")
        self.cpp_failed: str | None = None  # why a C++ wrapper failed to compile (that part then got Python's)
        self._marker = torch.empty(0, dtype=torch.uint8)  # the attending parts' slot markers are views of it
        self._parts: dict = {}  # key -> (compiled callable, names of the weight inputs)
        self._structures: dict = {}  # id(block) -> (_structure, block)
        self._keys: dict = {}  # (part, scale, id(block)...) -> [blocks, the inputs' layouts, the part's key, part]
        self._inputs: dict = {}  # (part, id(block), id(next block)) -> the weights, in the traced order
        self.compile_seconds = 0.0
        self.compile_log: list = []  # (part, seconds) of each part compiled
        self.compiled = 0
        self.failed: str | None = None
        # the whole step's calls, found once for steps alike (`_whole_plan`), per store (sessions taking turns
        # keep theirs: the crossing's measurement alternates two): the last PLANS stores'
        self._plans: dict[int, _WholePlan] = {}

    def _structure(self, block) -> tuple:
        entry = self._structures.get(id(block))
        if entry is None or entry[1] is not block:
            entry = self._structures[id(block)] = (_structure(block), block)
        return entry[0]

    def _part(self, name: str, blocks: tuple, tensors: list, attend: float | None = None):
        """The compiled part `name` for these blocks' structure and these tensor inputs (padded), traced and
        compiled the first time (the generated code is specialised to the inputs' sizes and strides but an
        attending part's slot and its store's capacity; an attending part also to its `attend`, the scale)."""
        seen = self._seen(name, blocks, tensors, attend)
        if seen[3] is not None:  # these inputs' part, found before (its key, a long tuple, is not hashed again)
            return seen[3]
        key = seen[2]
        part = self._parts.get(key)
        if part is None:
            from torch._subclasses.fake_tensor import FakeTensorMode
            from torch.func import functional_call
            from torch.fx.experimental.proxy_tensor import make_fx
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            t0 = time.perf_counter()
            symbolic = attend is not None
            make, base = PARTS[name]
            wrapper = make(*blocks) if attend is None else make(*blocks, attend)
            weights = _weights(blocks)
            names = list(weights)
            n = len(names)
            has_rope = len(tensors) > base

            def traced(*flat):
                rest = list(flat[n:-1] if symbolic else flat[n:])
                args = rest[:base]
                if name in ROTATES:
                    args.append(_rope(rest[base:]) if has_rope else None)
                if symbolic:  # the slot, the size of the marker after the tensors
                    args.append(flat[-1].shape[0] - _SLOT_MARGIN)
                return functional_call(wrapper, dict(zip(names, flat[:n])), tuple(args))

            fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))  # equal examples, not one symbol
            example = [_symbolic(fake_mode, t, None) for t in weights.values()]
            example += [_symbolic(fake_mode, t, i if symbolic else None) for i, t in enumerate(tensors)]
            if symbolic:
                example.append(_symbolic_slot(fake_mode))
            graph = make_fx(traced, tracing_mode="symbolic")(*example)
            fn = self._compile(name, graph, example)
            part = self._parts[key] = (fn, names)
            self.compile_log.append((name, time.perf_counter() - t0))
            self.compile_seconds += self.compile_log[-1][1]
            self.compiled += 1
        seen[3] = part
        return part

    def _compile(self, name: str, graph, example: list):
        """Inductor's compiled callable of a traced part. On a CPU its wrapper (what allocates the buffers and
        calls the kernels and the weight ops) is generated as C++ (`cpp_wrapper`): a call is then one Python
        call into it, where the Python wrapper makes tens per part (size and stride checks, allocations, the
        ops' Python dispatch). Where the C++ wrapper fails to compile, the Python one serves (`cpp_failed`).
        Off by default: a batch-1 step of the default model took as long with either wrapper once the Python one
        checks no sizes and the whole step finds its parts once (results/compiled_step/chat_b1_overhead.md), and
        the C++ one compiles ~20 s longer cold."""
        cpu = all(t.device.type == "cpu" for t in example)
        with _inductor_cache():
            if self.cpp_wrapper and cpu:
                try:
                    fn = torch._inductor.compile(graph, example, options={**_OPTIONS, "cpp_wrapper": True})
                    self.wrappers[name] = "cpp"
                    return fn
                except Exception as err:  # noqa: BLE001 -- the Python wrapper computes the same
                    self.cpp_failed = f"{name}: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:200]
            fn = torch._inductor.compile(graph, example, options=_OPTIONS)
            self.wrappers[name] = "python"
            return fn

    def _slot_marker(self, slot: int, capacity: int) -> torch.Tensor:
        """A tensor of slot + `_SLOT_MARGIN` elements: how an attending part is told its slot (a view of one
        buffer, made once for a store of `capacity` slots; its contents are never read)."""
        if self._marker.shape[0] < capacity + _SLOT_MARGIN:
            self._marker = torch.empty(capacity + _SLOT_MARGIN, dtype=torch.uint8)
        return self._marker[:slot + _SLOT_MARGIN]

    def _seen(self, name: str, blocks: tuple, tensors: list, attend: float | None) -> list:
        """[blocks, layouts, key, part] of the part these inputs call: its key (its structure and the inputs'
        signatures) and, once compiled or found, the part, remembered for the inputs' raw layouts (a step calls
        each part with the same layouts at every layer and every step, so the signatures are worked out once)."""
        layouts = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
        memo = (name, attend, *map(id, blocks))
        seen = self._keys.get(memo)
        if seen is not None and seen[1] == layouts and all(a is b for a, b in zip(seen[0], blocks)):
            return seen
        symbolic = attend is not None
        key = (name, attend, *(self._structure(b) for b in blocks),
               *(_signature(t, i if symbolic else None) for i, t in enumerate(tensors)))
        seen = self._keys[memo] = [blocks, layouts, key, None]
        return seen

    def _call(self, name: str, blocks: tuple, tensors: list, rows: int, attend: float | None = None,
              slot: torch.Tensor | None = None):
        """The part's outputs for these rows. The dense parts pad the rows to a power of two and take
        contiguous inputs; an attending part (`attend` given; `slot`: the marker of where it writes the token,
        `_slot_marker`) takes its inputs as they are: its rows are a power of two already, and it writes into the
        store's own tensors."""
        pad = _bucket(rows) - rows
        if pad:
            tensors = [torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in tensors]
        elif attend is None:
            tensors = [t.contiguous() for t in tensors]
        fn, weights = self._resolve(name, blocks, tensors, attend)
        out = fn(*weights, *tensors) if slot is None else fn(*weights, *tensors, slot)
        return [o[:rows] for o in out] if pad else list(out)

    def _resolve(self, name: str, blocks: tuple, tensors: list, attend: float | None = None) -> tuple:
        """(the compiled part these inputs call, its blocks' weights in the traced order)."""
        fn, names = self._part(name, blocks, tensors, attend)
        key = (name, *(id(b) for b in blocks))
        weights = self._inputs.get(key)
        if weights is None:
            found = _weights(blocks)
            weights = self._inputs[key] = [found[n] for n in names]
        return fn, weights

    def warm(self, model, rows: int = 1) -> float:
        """Compile the parts for decoding steps of `rows` rows now (a server before it listens); the seconds
        it took. A failure is left for the first step to meet (and fall back from)."""
        t0 = time.perf_counter()
        layers, n = model.layers, _bucket(rows)
        cfg = model.cfg
        h = torch.zeros(n, 1, cfg.hidden_size, dtype=model.dtype, device=model.device)
        a = torch.zeros(n, cfg.num_heads, 1, cfg.head_dim, dtype=model.dtype, device=model.device)
        rope = model.rope(torch.zeros(n, 1, dtype=torch.long, device=model.device))
        calls = [("enter", (layers[0],), [h, *_rope_tensors(layers[0].own_rope(rope))])]
        if len(layers) > 1:
            calls.append(("between", (layers[0], layers[1]), [h, a, *_rope_tensors(layers[1].own_rope(rope))]))
        calls.append(("leave", (layers[-1],), [h, a]))
        if self.whole and not any(cfg.window(layer) is not None for layer in range(cfg.num_layers)):
            kv = torch.zeros(n, cfg.num_kv_heads, 1, cfg.head_dim, dtype=model.dtype, device=model.device)
            pool = torch.zeros(n, cfg.num_kv_heads, 2, cfg.head_dim, dtype=model.dtype, device=model.device)
            valid = torch.zeros(n, cfg.num_kv_heads, 2, dtype=torch.bool, device=model.device)
            pos = torch.zeros(n, cfg.num_kv_heads, 2, dtype=torch.long, device=model.device)
            store = [a, kv, kv, pool, pool, valid, pos, torch.zeros(n, dtype=torch.long, device=model.device)]
            if len(layers) > 1:
                calls.append(("attend_between", (layers[0], layers[1]),
                              [h, *store, *_rope_tensors(layers[1].own_rope(rope))], model.scale))
            calls.append(("attend_leave", (layers[-1],), [h, *store], model.scale))
        try:
            with torch.inference_mode():
                for name, blocks, tensors, *attend in calls:
                    self._part(name, blocks, [t for t in tensors if t is not None], *attend)
        except Exception:  # noqa: BLE001 -- the first step meets it again, warns and decodes eagerly
            pass
        return time.perf_counter() - t0

    def _try(self, name: str, blocks: tuple, tensors: list, rows: int, attend: float | None = None,
             slot: torch.Tensor | None = None):
        """The part's outputs, or None once compiling (or running what was compiled) failed: then the step
        goes on eagerly, and so does every later step."""
        try:
            return self._call(name, blocks, [t for t in tensors if t is not None], rows, attend, slot)
        except Exception as err:  # noqa: BLE001 -- whatever the compiler raises, the eager path is the answer
            return self._fail(err)

    def _fail(self, err: Exception) -> None:
        """Compiling or running a part failed: one warning; this step goes on eagerly from there, and every later
        step runs eagerly."""
        self.failed = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"[:200]
        warnings.warn(f"torch.compile failed, decoding eagerly ({self.failed})", RuntimeWarning, stacklevel=5)

    def run(self, model, h, rope, attend, event, session=None) -> torch.Tensor:
        """The blocks of a decoding step over h [B, 1, hidden] (each layer's attention and events in the
        order `Block.forward` has them) and the head: logits [B, V]. `session`: the one session decoded
        (`attend`, `event` are its own), whose step runs whole where it reads its store densely in place."""
        layers, rows = model.layers, h.shape[0]
        if self.failed is not None or rows > MAX_BUCKET:
            return _eager_from(model, 0, h, rope, attend, event)
        if session is not None and self.whole and self.runs_whole(model, session):
            return self._run_whole(model, h, rope, session)
        got = self._try("enter", (layers[0],), [h, *_rope_tensors(layers[0].own_rope(rope))], rows)
        if got is None:
            return _eager_from(model, 0, h, rope, attend, event)
        x, q, k, v = got
        for i, block in enumerate(layers):
            event(i, "attn_in", x)
            a = attend(i, q, k, v)
            if i + 1 < len(layers):
                nxt = layers[i + 1]
                got = self._try("between", (block, nxt), [h, a, *_rope_tensors(nxt.own_rope(rope))], rows)
            else:
                got = self._try("leave", (block,), [h, a], rows)
            if got is None:  # this layer's attention has run: the rest of it, then the later layers, eagerly
                h1 = block.attention_output(h, a)
                event(i, "attn_out", h1)
                return _eager_from(model, i + 1, block.feed_forward(h1), rope, attend, event)
            h1, h = got[:2]
            if i + 1 < len(layers):
                x, q, k, v = got[2:]
            event(i, "attn_out", h1)
        return model.head(h[:, -1])


    # ---- the whole step: each layer's attention inside the compiled region ----------------------------------
    def runs_whole(self, model, session) -> bool:
        """Whether this decoding step of `session` runs whole (`_run_whole`): every layer reads every used slot
        of a store that attention may read in place (the full cache; a policy reading densely this step, as
        InfiniGen below its crossing), no policy wants the weights, no layer has a window, the rows are a
        power of two, and every layer holds the same number of tokens with room for one more. A selecting
        layer's plan is asked for only once every selecting layer's is known (nothing is planned early)."""
        store, policy, rows = session.store, session.policy, session.batch
        if (rows != _bucket(rows) or not store.attends_in_place() or policy.needs_weights
                or len(set(store.length)) != 1 or store.length[0] >= store.capacity):
            return False
        cfg = model.cfg
        if any(cfg.window(layer) is not None for layer in range(cfg.num_layers)):
            return False
        if _reads_all_by_construction(session):
            return True
        selecting = [layer for layer in range(cfg.num_layers) if session.selects(layer)]
        if not all(policy.known_ahead(layer, session) for layer in selecting):
            return False
        return all(session.planned(layer) is ALL for layer in selecting)

    def _run_whole(self, model, h, rope, session) -> torch.Tensor:
        """A decoding step as one compiled call per layer: the call takes a layer's q, k, v and its store's
        tensors, writes the token's k, v (and its valid mark and position) at the next slot in place, and runs
        its attention over the used slots, its residual and MLP and the next layer's attention input. The
        session's per-layer bookkeeping runs as in its own attention (`Session._read`: the plan, listeners,
        counters; the store's append pointer; policy and listeners hear of the append), with the events in the
        compiled parts' order."""
        blocks, store, rows = list(model.layers), session.store, h.shape[0]
        attend, n = model.scale, len(blocks)
        got = self._try("enter", (blocks[0],), [h, *_rope_tensors(blocks[0].own_rope(rope))], rows)
        if got is None:
            return _eager_from(model, 0, h, rope, session.attend, session.event)
        x, q, k, v = got
        slot = store.length[0]  # every layer's token goes there (`runs_whole`: the layers hold as many)
        marker = self._slot_marker(slot, store.capacity)  # how the attending parts are told the slot
        light = _reads_all_by_construction(session)
        cur = session.positions[:, 0]
        slots = torch.full((rows, k.shape[1]), slot, dtype=torch.long, device=k.device)  # what `append` returns
        ropes = [[t for t in _rope_tensors(b.own_rope(rope)) if t is not None] for b in blocks[1:]]
        key, plan = self._whole_plan(blocks, store, attend, [h, q, k, v, cur], ropes)
        calls = []  # this step's (part, weights, pool tensors' ids) per layer: the next steps' plan
        for i, block in enumerate(blocks):
            session.event(i, "attn_in", x)
            if light:  # what `Session._read` does when every layer reads all, nobody asked: the counters
                session.stats.record_rows(i, rows * k.shape[1] * slot)
                session.stats.record_all(i, rows, k.shape[1], slot)
            else:
                read = session._read(i, q, k)
                if read.rows is not None:
                    raise RuntimeError(f"layer {i} does not read its store in place in a whole step")
            pools = (store.k[i], store.v[i], store.valid[i], store.pos[i])
            tensors = [h, q, k, v, *pools, cur, *(ropes[i] if i + 1 < n else ())]
            ids = tuple(map(id, pools))
            try:
                if plan is not None and plan.calls[i][2] == ids:
                    fn, weights = plan.calls[i][:2]
                else:  # found by every input's layout (and from here on in this step)
                    plan = None
                    fn, weights = self._resolve(*(("attend_between", (block, blocks[i + 1])) if i + 1 < n
                                                   else ("attend_leave", (block,))), tensors, attend)
                calls.append((fn, weights, ids))
                got = fn(*weights, *tensors, marker)
            except Exception as err:  # noqa: BLE001 -- whatever the compiler raises, the eager path is the answer
                got = self._fail(err)
            if got is None:  # this layer's append and attention eagerly, as the session's own, then the rest
                from .runtime import attend_all
                slots = store.append(i, k, v, cur)
                a = attend_all(q, *store.used_keys_values(i), model.scale)
                session._appended(i, slots, k, v)
                h1 = block.attention_output(h, a)
                session.event(i, "attn_out", h1)
                return _eager_from(model, i + 1, block.feed_forward(h1), rope, session.attend, session.event)
            store.wrote_in_place(i)
            session._appended(i, slots, k, v)
            h1, h = got[:2]
            if i + 1 < n:
                x, q, k, v = got[2:]
            session.event(i, "attn_out", h1)
        if plan is None and key is not None:
            self._plans.pop(id(store), None)
            self._plans[id(store)] = _WholePlan(key, blocks, calls)
            while len(self._plans) > PLANS:
                del self._plans[next(iter(self._plans))]  # the store planned longest ago
        return model.head(h[:, -1])

    def _whole_plan(self, blocks: list, store, attend: float, first: list, ropes: list):
        """The whole step's calls of the store's last step that found them, where this step makes the same
        calls: the same blocks, store and scale, layer 0's inputs (its hidden state, the enter part's q, k, v,
        the positions, the rotary tensors, which every layer shares) of the same layouts. Each layer's inputs
        then have the layouts they had at that step: its pool tensors are the same (checked per layer), and its
        h, q, k, v are what the same part made of inputs of the same layouts. Returns (this step's key, that plan);
        the plan None: this step finds each layer's part by its inputs; the key None too: nor is its plan kept."""
        if any(len(r) != len(ropes[0]) or any(a is not b for a, b in zip(r, ropes[0])) for r in ropes[1:]):
            return None, None  # layers rotating differently: each layer's inputs are checked
        key = (weakref.ref(store), store.capacity, attend, len(blocks),
               *((t.shape, t.stride(), t.dtype, t.device) for t in (*first, *(ropes[0] if ropes else ()))))
        plan = self._plans.get(id(store))
        if plan is None or plan.key != key or any(a is not b for a, b in zip(plan.blocks, blocks)):
            return key, None
        return key, plan


class _WholePlan:
    """The calls a whole step made, layer by layer: (part, its weights, the ids of the layer's pool tensors)."""

    def __init__(self, key: tuple, blocks: list, calls: list):
        self.key, self.blocks, self.calls = key, blocks, calls


def _reads_all_by_construction(session) -> bool:
    """Whether every layer of `session` reads all of its store this step with nothing to decide or tell: the
    policy says so before the step's first layer (`Policy.reads_all`: the full cache, InfiniGen below its
    crossing), nothing is planned, and no listener hears of selections."""
    from .runtime import Listener
    return (not session._plans and session.policy.reads_all(session)
            and all(type(lis).on_select is Listener.on_select for lis in session.listeners))


@contextlib.contextmanager
def _inductor_cache():
    """Inductor's artifacts under the infinigen cache (kept across runs, beside the converted models) while
    compiling, unless the user chose a folder: torch reads TORCHINDUCTOR_CACHE_DIR at each use, and sets it
    to its /tmp default the first time anything asks, so a value equal to that default is not a choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if before is not None and os.path.abspath(before) != os.path.abspath(default_cache_dir()):
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def _eager_from(model, start: int, h, rope, attend, event) -> torch.Tensor:
    """The blocks from layer `start` on (h: its input) and the head, as `Block.forward` runs them."""
    for block in model.layers[start:]:
        h = block(h, rope, attend, event)
    return model.head(h[:, -1])


def _rope_tensors(rope) -> tuple:
    return (None,) if rope is None else tuple(rope)


def _rope(tensors):
    from .model import Rope
    return Rope(*tensors)


def resolve(mode: str, device_type: str, long_running: bool) -> str | None:
    """Whether `mode` compiles here: None (it does) or why not. "auto" compiles where it pays: a CPU with a
    C++ compiler, for long-running work (a server, a benchmark), where the compile time (seconds from
    Inductor's cache, about a minute cold on 2 cores) is paid once; a short generation runs eagerly. CUDA
    is compiled only on request ("on"): that path has not run on a GPU yet."""
    if mode not in MODES:
        raise ValueError(f"compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return "off"
    if mode == "auto" and (device_type != "cpu" or not long_running):
        return "auto: compiled only for long-running work on a CPU"
    return available()


def enable(model, mode: str = "on", long_running: bool = True) -> StepParts | None:
    """Compile `model`'s decoding steps (`model.step_parts`, used by `runtime.decode`); None when `mode` or
    the machine rules it out. A model whose blocks carry hooks (weight streaming, probes) stays eager: a
    hook is Python that must run at its point in the block."""
    why = resolve(mode, model.device.type, long_running)
    if why is None and any(m._forward_hooks or m._forward_pre_hooks for m in model.layers.modules()):
        why = "the blocks carry hooks"
    model.step_parts = None if why else StepParts(whole=mode != "parts")
    if why and mode in ("on", "whole", "parts"):
        warnings.warn(f"decoding eagerly: {why}", RuntimeWarning, stacklevel=2)
    return model.step_parts


def disable(model) -> None:
    model.step_parts = None
