"""Text generation on the runtime: batching with left padding, sampling, EOS, chat template, streaming.

Every argument is checked before anything is allocated, and so is the memory a batch needs
(`check_batch_memory`: the KV cache, the logits and the activations against what the machine has left),
so a batch that cannot fit is a UserError, not the allocator's error or the kernel's OOM killer."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import runtime
from .errors import ArgumentError, UserError
from .placement import Placement, kv_slot_bytes
from .policies import FullCache, Policy

SEED_MAX = 2 ** 63 - 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        t, p = self.temperature, self.top_p
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise UserError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UserError(f"top_k must be a whole number >= 0 (0: off), got {self.top_k!r}")
        if not _is_number(p) or not math.isfinite(p) or not 0 < p <= 1:
            raise UserError(f"top_p must be a number in (0, 1], got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise UserError(f"seed must be a whole number from 0 to {SEED_MAX}, got {self.seed!r}")


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt
    texts: list[str]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    stats: object = None
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        n = sum(len(t) for t in self.tokens) - len(self.tokens)  # the first token comes from prefill
        return n / self.decode_s if self.decode_s > 0 else float("nan")


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row from logits [B, V]."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > s.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def prompt_list(prompts) -> list[str]:
    """The prompts as a list: one string is one prompt (not one prompt per character); a list, tuple or
    other iterable of strings is a batch (it may be empty)."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None or isinstance(prompts, (bytes, bytearray, dict)) or not hasattr(prompts, "__iter__"):
        raise UserError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
    out = list(prompts)
    for i, p in enumerate(out):
        if not isinstance(p, str):
            raise UserError(f"prompts must be strings, but prompt {i} is {type(p).__name__}")
    return out


def as_policy(policy) -> Policy:
    """A Policy from a policy object, a policy name ("infinigen": `make_policy(name)`) or None (the full cache)."""
    if policy is None:
        return FullCache()
    if isinstance(policy, str):
        from .policies import make_policy
        return make_policy(policy.strip())
    if not isinstance(policy, Policy):
        raise UserError(f"policy must be a policy name or a Policy (make_policy), got {type(policy).__name__}")
    return policy


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    out = []
    for p in prompt_list(prompts):
        if not p or not p.strip():
            raise UserError("the prompt is empty")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ArgumentError("chat", "asks for the chat template, but this model's tokenizer has none")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p)["input_ids"]
        out.append(list(ids))
    return out


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.bool)
    for i, s in enumerate(seqs):
        tokens[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = True
    return tokens.to(device), mask.to(device)


def stop_ids(model, tokenizer) -> set[int]:
    ids = set(model.cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# ---- memory -------------------------------------------------------------------------------------------
def _read_kib(path: str, key: str) -> int | None:
    """`key:  N kB` of a /proc file, in bytes (None where there is no such file or line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup may still charge before its limit: the limit less what it uses
    beyond the page cache (reclaimable, as in MemAvailable); None without a limit. cgroup v2 or v1; the
    group's own folder, or the mount's root where a container shows only its own group there."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, rel in lines:
        if controllers == "":  # v2
            mount, names = "/sys/fs/cgroup", ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):  # v1
            mount, names = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        for folder in (os.path.join(mount, rel.lstrip("/")), mount):
            try:
                with open(os.path.join(folder, names[0])) as f:
                    limit = f.read().strip()
                with open(os.path.join(folder, names[1])) as f:
                    used = int(f.read().strip())
                with open(os.path.join(folder, "memory.stat")) as f:
                    cache = next((int(line.split()[1]) for line in f if line.split()[0] == names[2]), 0)
            except (OSError, ValueError, IndexError):
                continue
            if limit == "max" or int(limit) >= 1 << 62:  # v1 writes "no limit" as a page-rounded 2**63 - 1
                break
            return max(0, int(limit) - (used - cache))
    return None


def free_memory(device) -> dict[str, int]:
    """What can still be allocated, by bound, in bytes: "ram" (the kernel's MemAvailable, or the cgroup's
    room when smaller), "address space" (RLIMIT_AS, `ulimit -v`, less what the process maps already: it
    also bounds memory-mapped files) and, for a CUDA device, "GPU memory" (free). A bound that cannot be
    read is left out."""
    out = {}
    ram = _read_kib("/proc/meminfo", "MemAvailable")
    if ram is None:
        try:
            ram = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            ram = None
    room = _cgroup_room()
    if room is not None:
        ram = room if ram is None else min(ram, room)
    if ram is not None:
        out["ram"] = ram
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        mapped = _read_kib("/proc/self/status", "VmSize")
        if limit != resource.RLIM_INFINITY and mapped is not None:
            out["address space"] = max(0, limit - mapped)
    except (ImportError, OSError, ValueError):
        pass
    if torch.device(device).type == "cuda":
        try:
            out["GPU memory"] = torch.cuda.mem_get_info(torch.device(device))[0]
        except (RuntimeError, AssertionError):
            pass
    return out


def batch_memory(model, rows: int, prompt_len: int, max_new_tokens: int, policy: Policy | None = None,
                 placement: Placement | None = None, sampling: Sampling | None = None,
                 padded: bool = True) -> dict[str, int]:
    """Bytes a generation of `rows` prompts of up to `prompt_len` tokens plus `max_new_tokens` allocates
    beyond the weights, by part: "kv" (the pool with its slot metadata; "kv_tier" says where it lives:
    none, cpu or disk), "policy" (a non-exact policy's per-slot state, counted as the key cache again: what
    InfiniGen's partial keys take at most), "logits" (the prefill's and each step's [rows, vocab] scores in
    the model dtype and in float32, and sampling's copies), "activations" (the prefill's hidden states, q/k/v,
    MLP and, for padded prompts, the attention mask and one chunk of scores: the largest that coexist)."""
    from .model import PREFILL_CHUNK
    cfg = model.cfg
    placement = placement or Placement()
    elem = torch.empty((), dtype=model.dtype).element_size()
    max_len = prompt_len + max_new_tokens
    slots = placement.pool_tokens(model, rows, max_len, policy)
    kv = slots * kv_slot_bytes(model, rows, policy, placement.kv_offload, placement.pack)
    meta = cfg.num_layers * rows * cfg.num_kv_heads * slots * 9  # valid (bool) + position (int64) per slot
    state = 0 if policy is None or policy.exact else slots * cfg.kv_bytes_per_token(elem) * rows // 2
    v = cfg.vocab_size
    per_row = elem + 4  # the head's output and its float32 copy
    if sampling is not None and sampling.temperature > 0:
        per_row += 8 + (4 if sampling.top_k else 0) + (30 if sampling.top_p < 1 else 0)  # scaled, probs; sort
    logits = rows * v * per_row
    t = prompt_len
    width = 4 * cfg.hidden_size + 3 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * cfg.intermediate_size
    acts = rows * t * (width * elem + 17)  # + token ids, positions (int64) and the padding mask
    if padded:  # the [rows, 1, t, t] mask, and a chunk of expanded mask + float scores per attention call
        acts += 2 * rows * t * t + rows * cfg.num_heads * min(t, PREFILL_CHUNK) * t * (1 + 4 + 4)
    return {"kv": kv + meta, "kv_tier": placement.kv_offload, "policy": state, "logits": logits, "activations": acts}


def check_batch_memory(model, rows: int, prompt_len: int, max_new_tokens: int, policy: Policy | None = None,
                       placement: Placement | None = None, sampling: Sampling | None = None,
                       padded: bool = True) -> dict[str, int]:
    """UserError when what `batch_memory` counts does not fit what `free_memory` says is left (in RAM, in
    the address space, on the GPU); returns the parts counted. Call it before allocating anything."""
    need = batch_memory(model, rows, prompt_len, max_new_tokens, policy, placement, sampling, padded)
    have = free_memory(model.device)
    kv, tier = need["kv"], need["kv_tier"]
    fast = need["policy"] + need["logits"] + need["activations"] + (kv if tier == "none" else 0)
    on_gpu = torch.device(model.device).type == "cuda"
    bounds = {"GPU memory": fast if on_gpu else 0,
              "ram": (0 if on_gpu else fast) + (kv if tier == "cpu" else 0),
              # every allocation and every mapping of the process, the disk pool's file too
              "address space": (0 if on_gpu else fast) + (kv if tier != "none" else 0)}
    for bound, n in bounds.items():
        if bound in have and n > have[bound]:
            gib = lambda x: f"{x / 2**30:.2f} GiB"  # noqa: E731
            what = {"ram": "of RAM", "address space": "of address space (ulimit -v)",
                    "GPU memory": "of GPU memory"}[bound]
            plural = lambda n, word: f"{n} {word}{'s' * (n != 1)}"  # noqa: E731
            raise UserError(
                f"a batch of {plural(rows, 'prompt')} of up to {plural(prompt_len, 'token')} plus "
                f"{plural(max_new_tokens, 'new token')} needs about {gib(n)} (KV cache {gib(kv)}, logits "
                f"{gib(need['logits'])}, activations {gib(need['activations'])}), but only {gib(have[bound])} "
                f"{what} is free: use fewer prompts, shorter ones or fewer new tokens")
    return need


def _empty_generation() -> Generation:
    return Generation(tokens=[], texts=[], prompt_tokens=0, prefill_s=0.0, decode_s=0.0, decode_steps=0)


@torch.inference_mode()
def generate_ids(model, prompt_ids: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
                 policy: Policy | str | None = None, eos: set[int] = frozenset(), pad_id: int = 0,
                 on_token: Callable[[int, int], None] | None = None, placement: Placement | None = None,
                 tokenizer=None) -> Generation:
    """Generate for token-id prompts. `on_token(row, token)` sees every new token as it is chosen.
    `placement`: where the KV pool lives and how large it is (None: in fast memory, unlimited);
    `tokenizer`: lets the policy calibrate what it needs (`Policy.prepare`) on a fresh install.
    Every argument, and the memory the batch needs, is checked before anything is allocated."""
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise UserError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    sampling.validate()
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    policy = as_policy(policy)
    if placement is not None and not isinstance(placement, Placement):
        raise UserError(f"placement must be a Placement, got {type(placement).__name__}")
    prompt_ids = [list(p) for p in prompt_ids]
    if not prompt_ids:
        return _empty_generation()
    if not all(prompt_ids):
        raise UserError("a prompt has no tokens")
    longest = max(len(p) for p in prompt_ids)
    if longest + max_new_tokens > model.cfg.max_position:
        raise UserError(f"prompt ({longest} tokens) + max-new-tokens ({max_new_tokens}) exceeds the model's context of {model.cfg.max_position}")
    check_batch_memory(model, len(prompt_ids), longest, max_new_tokens, policy, placement, sampling,
                       padded=len({len(p) for p in prompt_ids}) > 1)
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=model.device).manual_seed(sampling.seed)
    tokens, mask = left_pad(prompt_ids, pad_id, model.device)
    b = tokens.shape[0]
    policy = policy.prepare(model, tokenizer, longest=longest + max_new_tokens, batch=b)
    sess = (placement or Placement()).new_session(model, b, longest + max_new_tokens, policy, prompt_len=longest)
    try:
        return _generate(model, sess, tokens, mask, max_new_tokens, sampling, gen, eos, on_token)
    finally:
        sess.store.close()


def _generate(model, sess, tokens, mask, max_new_tokens, sampling, gen, eos, on_token) -> Generation:
    b = tokens.shape[0]
    t0 = time.perf_counter()
    logits = runtime.prefill(model, tokens, sess, pad_mask=mask)
    nxt = sample(logits, sampling, gen)
    t1 = time.perf_counter()
    out: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    steps = 0
    for step in range(max_new_tokens):
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(tok)
                if on_token:
                    on_token(i, tok)
                if tok in eos:
                    done[i] = True
        if done.all() or step == max_new_tokens - 1:
            break
        nxt = sample(runtime.decode(model, nxt, sess), sampling, gen)
        steps += 1
    t2 = time.perf_counter()
    return Generation(tokens=out, texts=[], prompt_tokens=int(mask.sum()), prefill_s=t1 - t0,
                      decode_s=t2 - t1, decode_steps=steps, stats=sess.stats)


class TextStreamer:
    """Prints one row's text as it grows, decoding the whole row each time so multi-token characters
    come out right."""

    def __init__(self, tokenizer, row: int = 0, write=print):
        self.tok, self.row, self.ids, self.shown, self.write = tokenizer, row, [], "", write

    def __call__(self, row: int, token: int) -> None:
        if row != self.row:
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.write(text[len(self.shown):])
            self.shown = text


def generate(model, tokenizer, prompts: str | list[str], max_new_tokens: int = 64, sampling: Sampling | None = None,
             policy: Policy | str | None = None, chat: bool = False, on_token=None,
             placement: Placement | None = None) -> Generation:
    """Generate text for each prompt (one string: one prompt; an empty list: an empty result); `policy` is a
    Policy or a name for `make_policy`. See `generate_ids`."""
    prompts = prompt_list(prompts)
    if sampling is not None and not isinstance(sampling, Sampling):
        raise UserError(f"sampling must be a Sampling, got {type(sampling).__name__}")
    (sampling or Sampling()).validate()  # before tokenizing a large batch
    policy = as_policy(policy)
    ids = encode_prompts(tokenizer, prompts, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model.cfg.eos_token_ids or [0])[0]
    g = generate_ids(model, ids, max_new_tokens, sampling, policy, stop_ids(model, tokenizer), pad, on_token, placement,
                     tokenizer)
    g.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in g.tokens]
    return g
