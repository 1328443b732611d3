"""Continuous batching over the KV pool.

Every request has its own `Session` (batch 1): its own KV store, policy state and positions. One engine
step decodes every running request at once (`runtime.decode` over their sessions): everything that is per
token (embedding, norms, the q/k/v and output projections, the MLP, the LM head) runs on the rows stacked
into one batch, each request's policy selects from its own store, and each layer's attention is one call
over every request's rows, padded to the longest read (vLLM's idea: batched weights, per-sequence KV).
Joining and leaving is then trivial: a new request is prefilled alone between steps and joins the next
one; a finished or cancelled request closes its store, which frees its pool. A prompt's prefill runs on all of
torch's threads, a decoding step on `decode_threads` (a server on a CPU leaves one core to its other threads).

Admission: the KV memory is the limit. A request reserves what its session will hold in each tier for
prompt + max_tokens tokens (measured per token at start-up with a probe session, see `KVCost`) from two
budgets: the fast tier (RAM on a CPU host, GPU memory behind a GPU) and the slow tier that holds the
pool when it is offloaded. A request that does not fit yet waits in a bounded FIFO queue; beyond it,
`QueueFull` (the HTTP layer answers 429).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import runtime
from ..errors import UserError
from ..generate import Sampling, sample
from ..memory import device_memory_bytes, release_free_heap, session_bytes, storages
from .prefix import DiskTier, PrefixCache, prefix_fingerprint

log = logging.getLogger("infinigen.serve")


class QueueFull(Exception):
    """The waiting queue is full: try again later (HTTP 429)."""


def open_session(model, placement, policy, max_len: int):
    """A batch-1 session of up to `max_len` tokens in `placement`'s tier (its own store and policy state)."""
    return placement.new_session(model, 1, max_len, policy, prompt_len=None)


# ---- what a request holds -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCost:
    """Bytes a request of n tokens (prompt + max_tokens) holds: fast = fast0 + n * fast1, slow likewise.
    Measured on probe sessions filled to two lengths (so every per-token buffer, fetched rows and policy
    state included, has grown to its size at that length)."""
    fast0: int
    fast1: float
    slow0: int
    slow1: float

    def of(self, tokens: int) -> tuple[int, int]:
        return (int(self.fast0 + self.fast1 * tokens + 0.999), int(self.slow0 + self.slow1 * tokens + 0.999))

    @classmethod
    def measure(cls, model, placement, policy, shared: dict | None = None) -> "KVCost":
        ctx = model.cfg.max_position
        n2 = min(256, ctx)
        n1 = max(8, n2 // 2)
        g = torch.Generator().manual_seed(0)
        pts = []
        for n in (n1, n2):
            sess = open_session(model, placement, policy, n)
            try:
                prompt = torch.randint(0, model.cfg.vocab_size, (1, n - 2), generator=g).to(model.device)
                logits = runtime.prefill(model, prompt, sess)
                for _ in range(2):  # decoding fetches rows: their fast-tier buffers grow to this length
                    logits = runtime.decode(model, logits.argmax(-1), sess)
                pts.append(session_bytes(sess, shared))
            finally:
                sess.store.close()
        (f1, s1), (f2, s2) = pts
        df, ds = max(0.0, (f2 - f1) / (n2 - n1)), max(0.0, (s2 - s1) / (n2 - n1))
        return cls(max(0, int(f1 - df * n1)), df, max(0, int(s1 - ds * n1)), ds)


def default_decode_threads(device) -> int | None:
    """The torch threads a server's decoding step runs on unless told: on a CPU every one of torch's threads but
    one, at least one; elsewhere None (the count a prefill runs on). A step is many small operators per request
    and layer, which two threads do not speed up on a small host, and while it runs the HTTP thread (streaming
    each token) and the KV stores' fetch workers need a core: on 2 cores, 8 chat clients got 92.8 against 65.9
    tokens/s from InfiniGen serving on one decoding thread against two, 90.2 against 87.7 from the full cache
    (results/serve/decode_threads), prompts prefilled on both."""
    if torch.device(device).type != "cpu":
        return None
    return max(1, torch.get_num_threads() - 1)


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Inside: this thread's torch ops run on `n` intra-op threads (None: as they do), set back on leaving."""
    was = torch.get_num_threads()
    if n is None or n == was:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _check_whole(name: str, value, least: int) -> None:
    """UserError unless `value` is a whole number (not a bool) of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UserError(f"{name} must be a whole number >= {least}, got {value!r}")


def default_budgets(placement, device) -> tuple[int, int]:
    """(fast, slow) budgets when none is given: a quarter of the fast memory; for an offloaded pool, half of
    the host memory ("cpu") or half of the free disk where the pool files go ("disk")."""
    fast_total = device_memory_bytes(str(device)) or (8 << 30)
    fast = fast_total // 4
    kind = placement.kv_offload
    if kind == "none":
        return fast, fast
    if kind == "cpu":
        return fast, (device_memory_bytes("cpu") or (8 << 30)) // 2
    where = placement.pool_dir or tempfile.gettempdir()
    while where and not os.path.isdir(where):
        where = os.path.dirname(where)
    return fast, shutil.disk_usage(where or "/").free // 2


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of logits [N, V] and its token: (the token's log-probability, the k likeliest tokens with
    theirs). The model's own distribution (log_softmax of the raw logits): no temperature or top-p, as OpenAI
    reports them."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return [(c, []) for c in chosen]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return [(c, list(zip(ids, vals))) for c, ids, vals in zip(chosen, top.indices.tolist(), top.values.tolist())]


# ---- requests ----------------------------------------------------------------------------------------------
_ids = itertools.count(1)


@dataclass(eq=False)
class Request:
    """One generation. `sink(kind, value)` is called from the engine thread: ("token", id) for every new
    token, then once ("done", finish_reason) with "stop" (EOS, or `cancel(req, "stop")`), "length" or
    "cancelled", or ("error", msg).

    `logprobs`: None, or how many alternatives to report per token: each new token's
    (log-probability, [(token, log-probability)] of the `logprobs` likeliest) is appended to `token_logprobs`
    before the sink hears of the token. `prompt_logprobs`: the same for every prompt token after the first
    (`prompt_token_logprobs`, None for the first), from a prefill that keeps every position's logits."""
    prompt: list[int]
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    sink: Callable[[str, object], None] = lambda kind, value: None
    id: int = field(default_factory=lambda: next(_ids))
    logprobs: int | None = None
    prompt_logprobs: bool = False
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list | None = None
    # engine side
    tokens: list[int] = field(default_factory=list)
    cost: tuple[int, int] = (0, 0)
    session: object = None
    prefilling: object = None  # the prefill under way (`runtime.prefill_in_slices`), until its logits come
    generator: object = None
    cancelled: bool = False
    cancel_reason: str = "cancelled"
    finish: str | None = None
    arrived: float = field(default_factory=time.monotonic)


class Engine:
    """The scheduler and the decoding loop (its own thread, `start`); `submit` and `cancel` are thread-safe."""

    @classmethod
    def from_config(cls, model, policy, config, eos: set[int] | frozenset = frozenset()) -> "Engine":
        """The engine a `ServerConfig` describes (its placement, admission limits and prefix cache)."""
        from ..placement import Placement
        return cls(model, policy, Placement(kv_offload=config.kv_offload, pool_dir=config.pool_dir,
                                                  disk_block=config.disk_block), eos=eos,
                   max_batch=config.max_batch, max_queue=config.max_queue, fast_bytes=config.fast_bytes,
                   pool_bytes=config.pool_bytes, prefill_chunk_layers=config.prefill_chunk_layers,
                   prefix_cache=config.prefix_cache, prefix_cache_bytes=config.prefix_cache_bytes,
                   prefix_cache_dir=config.prefix_cache_dir, prefix_cache_dir_bytes=config.prefix_cache_dir_bytes,
                   batch_invariant=config.batch_invariant,
                   decode_threads=config.decode_threads or default_decode_threads(model.device))

    def __init__(self, model, policy=None, placement=None, eos: set[int] | frozenset = frozenset(),
                 max_batch: int = 16, max_queue: int = 64, fast_bytes: int | None = None,
                 pool_bytes: int | None = None, cost: KVCost | None = None, prefill_chunk_layers: int = 1,
                 prefix_cache: bool = True, prefix_cache_bytes: int | None = None, prefix_block: int = 256,
                 prefix_cache_dir: str | os.PathLike | None = None, prefix_cache_dir_bytes: int | None = None,
                 batch_invariant: bool = True, prefill_share: float = 1.0, decode_threads: int | None = None):
        from ..placement import Placement
        from ..policies import FullCache
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise UserError(f"max_queue must be >= 0, got {max_queue}")
        _check_whole("prefill_chunk_layers", prefill_chunk_layers, 0)
        # a prompt that joins running requests is prefilled in chunks of this many layers between their decode
        # steps, so their pace holds (0: the whole prompt in one step): a chunk each per step, and more while the
        # step's prefill has taken less than `prefill_share` of the last decode step (`_advance_prefills`)
        if not 0 <= prefill_share < float("inf"):
            raise UserError(f"prefill_share must be a number >= 0, got {prefill_share!r}")
        self.prefill_chunk_layers, self.prefill_share = prefill_chunk_layers, prefill_share
        # the torch threads a decoding step runs on (None: the engine thread's count, as prefills)
        if decode_threads is not None:
            _check_whole("decode_threads", decode_threads, 1)
        self.decode_threads = decode_threads
        self.decode_s = 0.0  # the last decode step's seconds
        # each request's attention is the call it makes alone (`runtime.decode`'s batch_invariant): its greedy
        # tokens do not depend on what runs beside it
        self.batch_invariant = batch_invariant
        self.model, self.policy = model, policy or FullCache()
        self.placement = placement or Placement()
        self.eos = frozenset(eos)
        self.max_batch, self.max_queue = max_batch, max_queue
        # tensors every request shares (skew matrices): not part of a request's cost
        self.shared = storages(self.policy, {})
        self.cost = cost or KVCost.measure(model, self.placement, self.policy, self.shared)
        fast_default, slow_default = default_budgets(self.placement, model.device)
        self.fast_budget = fast_bytes if fast_bytes is not None else fast_default
        if self.placement.kv_offload == "none":  # the pool is in the fast tier: one budget
            self.fast_budget = min(self.fast_budget, pool_bytes) if pool_bytes is not None else self.fast_budget
            self.slow_budget = 0
        else:
            self.slow_budget = pool_bytes if pool_bytes is not None else slow_default
        # prompts' shared prefixes kept for reuse (`serve/prefix.py`): for a policy whose state a continued
        # prefill rebuilds exactly, with the KV in fast memory or in block files on disk (a hit is written into
        # the request's file a cached block at a time); by default an eighth of the fast budget
        self.prefix = None
        in_blocks = self.placement.kv_offload == "disk" and self.placement.disk_block
        if prefix_cache and self.policy.continues_prefill() and (self.placement.kv_offload == "none" or in_blocks):
            limit = self.fast_budget // 8 if prefix_cache_bytes is None else prefix_cache_bytes
            if limit < 0:
                raise UserError(f"prefix_cache_bytes must be >= 0, got {limit}")
            disk = None
            if limit and prefix_cache_dir is not None:  # the persistent tier, by default 4x the memory's limit
                dir_limit = 4 * limit if prefix_cache_dir_bytes is None else prefix_cache_dir_bytes
                if dir_limit < 0:
                    raise UserError(f"prefix_cache_dir_bytes must be >= 0, got {dir_limit}")
                c = model.cfg
                disk = DiskTier(prefix_cache_dir, dir_limit, prefix_fingerprint(model), prefix_block,
                                (c.num_layers, c.num_kv_heads, c.head_dim, model.dtype), model.device)
            self.prefix = PrefixCache(limit, prefix_block, disk) if limit else None
        self.running: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.reserved = [0, 0]  # fast, slow bytes reserved by running requests
        self._finished_at_trim, self._trimmed_at = 0, 0.0  # `_trim_heap`
        self.in_use = [0, 0]  # measured after each step
        self.counters = collections.Counter()  # requests by outcome, tokens
        self.batch_sizes = collections.Counter()  # decode steps by how many requests each decoded together
        self._recent: collections.deque = collections.deque()  # (time, tokens) of the last steps
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- admission -----------------------------------------------------------------------------------
    def request_cost(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        fast, slow = self.cost.of(prompt_len + max_tokens)
        return fast, (slow if self.placement.kv_offload != "none" else 0)

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """UserError when the request could never run, even alone."""
        fast, slow = self.request_cost(prompt_len, max_tokens)
        if fast > self.fast_budget or slow > self.slow_budget and self.placement.kv_offload != "none":
            raise UserError(f"a request of {prompt_len} prompt tokens and max_tokens {max_tokens} needs {fast} bytes "
                            f"of fast memory and {slow} of KV pool; the server has {self.fast_budget} and "
                            f"{self.slow_budget}")

    def _fits(self, req: Request) -> bool:
        f, s = req.cost
        return (len(self.running) < self.max_batch and self.reserved[0] + f <= self.fast_budget
                and self.reserved[1] + s <= self.slow_budget)

    def submit(self, req: Request) -> Request:
        """Queue a request; QueueFull when `max_queue` requests wait already, UserError when it can never fit."""
        if req.max_tokens < 1:
            raise UserError("max_tokens must be >= 1")
        if not req.prompt:
            raise UserError("the prompt is empty")
        if len(req.prompt) + req.max_tokens > self.model.cfg.max_position:
            raise UserError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                            f"context of {self.model.cfg.max_position} tokens")
        req.sampling.validate()
        self.check_fits(len(req.prompt), req.max_tokens)
        req.cost = self.request_cost(len(req.prompt), req.max_tokens)
        with self._cv:
            # max_queue 0: a request runs if it fits now, and is refused otherwise
            if len(self.waiting) >= self.max_queue and not (not self.waiting and self._fits(req)):
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the server queues at most "
                                f"{self.max_queue})")
            self.waiting.append(req)
            self._cv.notify_all()
        return req

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Stop a request: it leaves before the next step and frees its slots, counted as `reason` ("cancelled":
        the client went away; "stop": a stop string ended it). A no-op once it finished."""
        with self._cv:
            if not req.cancelled:
                req.cancelled, req.cancel_reason = True, reason
            self._cv.notify_all()

    def cancel_all(self) -> None:
        """Cancel every running and waiting request (the server is stopping)."""
        with self._cv:
            for req in list(self.running) + list(self.waiting):
                self.cancel(req)

    # ---- the loop --------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Drop cancelled requests, admit and prefill what fits, decode one token for every running request.
        Returns whether there was anything to do."""
        with self._cv:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._finish(req, req.cancel_reason)
            admitted = []
            while self.waiting and self._fits(self.waiting[0]):  # FIFO: a long request is not starved
                req = self.waiting.popleft()
                self.reserved[0] += req.cost[0]
                self.reserved[1] += req.cost[1]
                self.running.append(req)
                admitted.append(req)
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, req.cancel_reason)
        for req in admitted:
            if req.cancelled:  # cancelled after it was admitted, before its prefill: it never ran
                self._finish(req, req.cancel_reason)
            else:
                self._prefill(req)
        self._advance_prefills(decoding=any(r.tokens and r.finish is None for r in self.running))
        # requests still prefilling, or cancelled while an earlier one of this step was prefilled, have no
        # token yet: they are not decoded now
        live = [r for r in self.running if r.finish is None and r.tokens]
        if live:
            self.batch_sizes[len(live)] += 1
            # an I/O error of one request's pool file fails that request only: the others' rows never depended
            # on its rows (decoded together: they attend without it)
            faults = {} if len(live) > 1 else None
            try:
                last = torch.tensor([r.tokens[-1] for r in live], device=self.model.device)
                started = time.perf_counter()
                with torch_threads(self.decode_threads):
                    logits = runtime.decode(self.model, last, [r.session for r in live],
                                            batch_invariant=self.batch_invariant, faults=faults)
                self.decode_s = time.perf_counter() - started
            except Exception as e:  # the batch fails, the server goes on
                log.exception("decode step failed")
                for r in live:
                    self._finish(r, "error", f"decode failed: {e}")
            else:
                for i, e in sorted((faults or {}).items()):
                    log.error("request %s: decode failed: %s", live[i].id, e)
                    self._finish(live[i], "error", f"decode failed: {e}")
                kept = [i for i in range(len(live)) if i not in (faults or {})]
                # the decode's own rate (tokens over seconds in decoding steps), apart from the prefills between
                self.counters["decode_tokens"] += len(kept)
                self.counters["decode_seconds"] += self.decode_s
                if kept:
                    self._take([live[i] for i in kept], logits[kept] if len(kept) < len(live) else logits)
        self._measure()
        return bool(admitted or live or any(r.prefilling is not None for r in self.running))

    def _advance_prefills(self, decoding: bool) -> None:
        """Carry the prompts being prefilled on. With nothing decoding, each runs through. Beside decoding requests,
        each advances a chunk of layers, then further chunks in turn while this step's prefill has taken less than
        `prefill_share` of the last decode step: a short prompt joining (a follow-up on a cached prefix) is done in
        a step or a few, a long one still advances a chunk a step, and beyond a chunk each the prefill delays the
        decoding by at most `prefill_share` of a step."""
        def prefilling():
            return [r for r in self.running if r.prefilling is not None and r.finish is None]
        started = time.perf_counter()
        for req in prefilling():
            self._advance_prefill(req, to_the_end=not decoding)
        budget = self.prefill_share * self.decode_s if decoding else 0.0
        while budget > 0 and (more := prefilling()):
            for req in more:
                if time.perf_counter() - started >= budget:
                    return
                self._advance_prefill(req, to_the_end=False)

    def _prefill(self, req: Request) -> None:
        """Open the request's session and start its prefill (`_advance_prefill` carries it on)."""
        try:
            if req.sampling.seed is not None:
                req.generator = torch.Generator(device=self.model.device).manual_seed(req.sampling.seed)
            req.session = open_session(self.model, self.placement, self.policy, len(req.prompt) + req.max_tokens)
            cached = 0
            if self.prefix is not None and not req.prompt_logprobs:  # echo scores every prompt token itself
                cached, blocks = self.prefix.lookup_blocks(req.prompt)
                for i, block in enumerate(blocks):  # one block at a time: the prefix is never copied whole
                    req.session.restore_prefix(block.keys, block.values, at=i * self.prefix.block_tokens)
            # with a prefix cache every prompt is prefilled in tiles of its blocks, so a hit's rows get the bits
            # a miss computes (a request's greedy answer does not depend on what was cached before it)
            req.prefilling = runtime.prefill_in_slices(
                self.model, torch.tensor([req.prompt[cached:]], device=self.model.device), req.session,
                all_logits=req.prompt_logprobs, layers_per_slice=self.prefill_chunk_layers, cached=cached,
                tile=self.prefix.block_tokens if self.prefix is not None else 0)
        except Exception as e:
            if not isinstance(e, UserError):
                log.exception("prefill failed")
            self._finish(req, "error", f"prefill failed: {e}")

    def _advance_prefill(self, req: Request, to_the_end: bool) -> None:
        """One chunk of the request's prefill (or all of it); once it is done, its first token."""
        try:
            while True:
                try:
                    next(req.prefilling)
                except StopIteration as done:
                    logits = done.value
                    break
                if not to_the_end:
                    return
            req.prefilling = None
            if self.prefix is not None:
                self.prefix.insert(req.prompt, req.session.store)
            if req.prompt_logprobs:  # position j's logits predict prompt token j + 1
                req.prompt_token_logprobs = [None] + token_logprobs(logits[0, :-1], req.prompt[1:], req.logprobs or 0)
                logits = logits[:, -1]
            self.counters["prompt_tokens"] += len(req.prompt)
            self._take([req], logits)
        except Exception as e:
            if not isinstance(e, UserError):
                log.exception("prefill failed")
            self._finish(req, "error", f"prefill failed: {e}")

    def _take(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample each request's next token (greedy rows at once), hand it over, retire finished requests."""
        greedy = logits.argmax(-1).tolist()
        for i, req in enumerate(reqs):
            s = req.sampling
            try:  # what fails for one request (its sampling, its log-probabilities) ends that request only
                tok = greedy[i] if s.temperature == 0 else int(sample(logits[i:i + 1], s, req.generator)[0])
                if req.logprobs is not None:
                    req.token_logprobs += token_logprobs(logits[i:i + 1], [tok], req.logprobs)
            except Exception as e:
                log.exception("sampling failed")
                self._finish(req, "error", f"sampling failed: {e}")
                continue
            req.tokens.append(tok)
            self.counters["completion_tokens"] += 1
            req.sink("token", tok)
            if tok in self.eos:
                self._finish(req, "stop")
            elif len(req.tokens) >= req.max_tokens:
                self._finish(req, "length")
        now = time.monotonic()
        self._recent.append((now, len(reqs)))
        while self._recent and self._recent[0][0] < now - 10:
            self._recent.popleft()

    def _finish(self, req: Request, reason: str, message: str | None = None) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        req.prefilling = None  # a prefill under way is dropped with its session
        if req.session is not None:
            try:
                req.session.store.close()
            except Exception:  # the request ends all the same; what its store held is released with it
                log.exception("closing request %s's store failed", req.id)
            finally:
                req.session = None
        with self._cv:
            if req in self.running:
                self.running.remove(req)
                self.reserved[0] -= req.cost[0]
                self.reserved[1] -= req.cost[1]
            self._cv.notify_all()
        self.counters["requests_" + reason] += 1
        req.sink("error" if reason == "error" else "done", message if reason == "error" else reason)

    def _measure(self) -> None:
        fast = slow = 0
        for r in self.running:
            if r.session is not None:
                f, s = session_bytes(r.session, self.shared)
                fast, slow = fast + f, slow + s
        self.in_use = [fast, slow]

    def tokens_per_s(self) -> float:
        recent = list(self._recent)
        if len(recent) < 2:
            return 0.0
        span = time.monotonic() - recent[0][0]
        return sum(n for _, n in recent) / span if span > 0 else 0.0

    def start(self) -> "Engine":
        with self._cv:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="infinigen-engine", daemon=True)
                self._thread.start()
        return self

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self.running and not self.waiting:
                    self._cv.wait()
                if self._stop:
                    break
            try:
                if not self.step():
                    with self._cv:  # waiting requests that do not fit yet: sleep until something changes
                        self._cv.wait(timeout=0.05)
                self._trim_heap()
            except Exception:
                log.exception("engine step failed")

    def _trim_heap(self, every_s: float = 2.0) -> None:
        """Once requests have finished or prompts been prefilled, at most every `every_s` seconds: their freed
        tensors' pages (a long prompt's activations) go back to the OS, so the server's RSS stays flat under
        requests of ever-different sizes and within a memory bound (a few ms per call)."""
        finished = sum(self.counters["requests_" + r] for r in ("stop", "length", "cancelled", "error"))
        finished += self.counters["prompt_tokens"]
        now = time.monotonic()
        if finished != self._finished_at_trim and now - self._trimmed_at >= every_s:
            self._finished_at_trim, self._trimmed_at = finished, now
            release_free_heap()

    def stop(self) -> None:
        """Stop the loop and cancel every request (their stores are closed)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        for req in list(self.waiting) + list(self.running):
            self._finish(req, "cancelled")
        self.waiting.clear()
        if self.prefix is not None and self.prefix.disk is not None:
            self.prefix.disk.flush()  # the blocks handed to the writer reach the folder before the process ends

    def describe(self) -> str:
        gib = 2 ** 30
        where = self.placement.describe(self.model.device)
        f1, s1 = self.cost.fast1, self.cost.slow1
        slow = f", KV pool budget {self.slow_budget / gib:.2f} GiB ({s1:.0f} B/token)" if self.slow_budget else ""
        p = self.prefix
        prefix = "no prefix cache" if p is None else f"prefix cache {p.max_bytes / gib:.2f} GiB" + (
            f" and {p.disk.max_bytes / gib:.2f} GiB in {p.disk.dir}" if p.disk is not None else "")
        return (f"policy {getattr(self.policy, 'name', '?')}, {where}; fast-memory budget "
                f"{self.fast_budget / gib:.2f} GiB "
                f"({f1:.0f} B/token){slow}; at most {self.max_batch} running, {self.max_queue} waiting; {prefix}"
                + ("; batch-invariant" if self.batch_invariant else "")
                + (f"; decoding on {self.decode_threads} of {torch.get_num_threads()} torch threads"
                   if self.decode_threads is not None else ""))

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def snapshot(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting), "reserved_fast_bytes": self.reserved[0],
                "reserved_slow_bytes": self.reserved[1], "kv_fast_bytes": self.in_use[0],
                "kv_slow_bytes": self.in_use[1],
                "fast_budget_bytes": self.fast_budget, "slow_budget_bytes": self.slow_budget,
                "tokens_per_s": self.tokens_per_s(), **dict(self.counters), **self._prefix_numbers()}

    def _prefix_numbers(self) -> dict:
        p = self.prefix
        if p is None:
            return {}
        return {"prefix_cache_hits": p.hits, "prefix_cache_hit_tokens": p.hit_tokens,
                "prefix_cache_evictions": p.evictions, "prefix_cache_bytes": p.bytes,
                "prefix_cache_limit_bytes": p.max_bytes, **self._disk_numbers()}

    def _disk_numbers(self) -> dict:
        d = self.prefix.disk
        if d is None:
            return {}
        return {"prefix_cache_disk_hits": d.hits, "prefix_cache_disk_hit_tokens": d.hit_tokens,
                "prefix_cache_disk_skipped": d.skipped, "prefix_cache_disk_evictions": d.evictions,
                "prefix_cache_disk_writes": d.writes, "prefix_cache_disk_bytes": d.bytes,
                "prefix_cache_disk_limit_bytes": d.max_bytes}
