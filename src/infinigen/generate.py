"""Text generation on the runtime: batching with left padding, sampling, EOS, chat template, streaming."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import runtime
from .errors import UserError
from .placement import Placement
from .policies import FullCache, Policy


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise UserError("temperature must be >= 0")
        if self.top_k < 0:
            raise UserError("top-k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise UserError("top-p must be in (0, 1]")


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


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    out = []
    for p in prompts:
        if not p or not p.strip():
            raise UserError("the prompt is empty")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise UserError("--chat: this model's tokenizer has no chat template")
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


@torch.inference_mode()
def generate_ids(model, prompt_ids: list[list[int]], max_new_tokens: int, sampling: Sampling | None = None,
                 policy: Policy | None = None, eos: set[int] = frozenset(), pad_id: int = 0,
                 on_token: Callable[[int, int], None] | None = None, placement: Placement | None = None,
                 tokenizer=None) -> Generation:
    """Generate for token-id prompts. `on_token(row, token)` sees every new token as it is chosen.
    `placement`: where the KV pool lives and how large it is (None: in fast memory, unlimited);
    `tokenizer`: lets the policy calibrate what it needs (`Policy.prepare`) on a fresh install."""
    sampling = sampling or Sampling()
    sampling.validate()
    if max_new_tokens < 1:
        raise UserError("max-new-tokens must be >= 1")
    longest = max(len(p) for p in prompt_ids)
    if longest + max_new_tokens > model.cfg.max_position:
        raise UserError(f"prompt ({longest} tokens) + max-new-tokens ({max_new_tokens}) exceeds the model's context of {model.cfg.max_position}")
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=model.device).manual_seed(sampling.seed)
    tokens, mask = left_pad(prompt_ids, pad_id, model.device)
    b = tokens.shape[0]
    policy = (policy or FullCache()).prepare(model, tokenizer)
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


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int = 64, sampling: Sampling | None = None,
             policy: Policy | None = None, chat: bool = False, on_token=None,
             placement: Placement | None = None) -> Generation:
    """Generate text for each prompt; see `generate_ids`."""
    ids = encode_prompts(tokenizer, prompts, chat)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model.cfg.eos_token_ids or [0])[0]
    g = generate_ids(model, ids, max_new_tokens, sampling, policy, stop_ids(model, tokenizer), pad, on_token, placement,
                     tokenizer)
    g.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in g.tokens]
    return g
