"""Few-shot multiple choice scored by log-likelihood, the way lm-evaluation-harness scores it.

For each example the prompt is the task prefix, `shots` solved examples drawn from the rest of the
task, and the question; each answer choice is a continuation. The score of a choice is the sum of
the log-probabilities of its tokens given the prompt (`acc`), or that sum divided by the choice's
length in bytes (`acc_norm`); the prediction is the best-scoring choice. Context and continuation
are tokenized as lm-eval does: the whole string once, the context's own tokens split off the front,
trailing spaces of the context moved to the continuation.

A policy acts on the continuation: the context is the prefill (dense attention, as a server would
process the prompt) and the choice's tokens are the decoded part, evaluated in teacher-forced mode
with the policy. `prefill_frac` < 1 moves the tail of the context into the decoded part as well, so
that the policy also shapes the hidden states the first answer token is predicted from (with the
default 1.0, a one-token choice is scored from the dense prompt and no policy can change it).
Agreement is the fraction of examples whose predicted choice equals the full cache's.

Tasks are BIG-bench JSON tasks (`task.json` with `examples: [{input, target_scores}]`), formatted as
BIG-bench formats them (task_prefix, example_input_prefix, example_output_prefix, choice_prefix,
append_choices_to_input); tasks with subtasks are named "task/subtask".
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import runtime
from ..errors import UserError
from ..placement import Placement



# ---- tasks -------------------------------------------------------------------------------------------
from ..paths import bigbench_dirs  # noqa: E402,F401  (one copy, in paths)


def find_root(root: str | os.PathLike | None = None) -> Path:
    if root is not None:
        p = Path(root).expanduser()
        if not p.is_dir():
            raise UserError(f"task folder not found: {p}")
        return p
    for d in bigbench_dirs():
        if d.is_dir() and any(d.glob("*/task.json")):
            return d
    looked = ", ".join(str(d) for d in bigbench_dirs())
    raise UserError(f"no BIG-bench task folder (*/task.json) in {looked}; give a task folder or set INFINIGEN_DATA")


class BadTask(ValueError):
    """A task.json that cannot be used, and why."""


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_task(path: Path) -> dict | None:
    """The parsed task.json of a multiple-choice task (examples with `input` text and `target_scores`
    mapping choice texts to finite numbers), None for a task of another kind (no `target_scores` at all);
    BadTask for a file that is not such a task (not UTF-8 JSON, not an object, a malformed example)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise BadTask(f"cannot be read ({e.strerror or e})")
    except UnicodeDecodeError:
        raise BadTask("is not UTF-8 text")
    except json.JSONDecodeError as e:
        raise BadTask(f"is not valid JSON ({e.msg}, line {e.lineno})")
    if not isinstance(data, dict):
        raise BadTask(f"holds a JSON {type(data).__name__}, not an object with examples")
    if "examples" not in data:
        return None  # a task of subtasks: they are tasks of their own
    examples = data["examples"]
    if not isinstance(examples, list):
        raise BadTask(f"examples is a JSON {type(examples).__name__}, not a list")
    if not any(isinstance(e, dict) and "target_scores" in e for e in examples):
        return None
    for i, e in enumerate(examples):
        if not isinstance(e, dict):
            raise BadTask(f"example {i} is not an object")
        if "target_scores" not in e:
            continue  # scored by another metric: not used here
        ts = e["target_scores"]
        if not isinstance(e.get("input"), str):
            raise BadTask(f"example {i} has no input text")
        if not isinstance(ts, dict) or not all(isinstance(k, str) and _number(v) for k, v in ts.items()):
            raise BadTask(f"example {i}: target_scores must map choice texts to numbers, got {json.dumps(ts)[:60]}")
    for key in ("task_prefix", "example_input_prefix", "example_output_prefix", "choice_prefix",
                "few_shot_example_separator"):
        if key in data and not isinstance(data[key], str):
            raise BadTask(f"{key} is not text")
    if "append_choices_to_input" in data and not isinstance(data["append_choices_to_input"], bool):
        raise BadTask("append_choices_to_input is not true or false")
    if not any(isinstance(e, dict) and e.get("target_scores") for e in examples):
        return None
    return data


def scan_tasks(root: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> task.json of every multiple-choice task, name -> what is wrong, naming the file, for each
    task.json that is broken); subtasks are "task/subtask"."""
    good, bad = {}, {}
    for f in sorted(root.glob("*/task.json")) + sorted(root.glob("*/*/task.json")):
        name = str(f.parent.relative_to(root))
        try:
            if read_task(f) is not None:
                good[name] = f
        except BadTask as e:
            bad[name] = f"{f} {e}"
    return good, bad


_WARNED: set = set()


def _warn_skipped(root: Path, bad: dict[str, str]) -> None:
    """One line on stderr per broken task (once per process and file version: a command lists the tasks
    more than once): the others still run."""
    import sys
    for name, why in bad.items():
        path = root / name / "task.json"
        try:
            key = (str(path), path.stat().st_mtime_ns)
        except OSError:
            key = (str(path), None)
        if key not in _WARNED:
            _WARNED.add(key)
            print(f"infinigen: warning: skipping BIG-bench task {name}: {why}", file=sys.stderr)


def list_tasks(root: Path) -> dict[str, Path]:
    """name -> task.json for every multiple-choice task (subtasks as "task/subtask"); a broken task.json
    is skipped with a warning naming it."""
    good, bad = scan_tasks(root)
    _warn_skipped(root, bad)
    return good


def resolve_tasks(spec: str, root: Path) -> list[str]:
    """Task names for "all", a name, a task with subtasks (all of them), or a comma-separated list. A broken
    task asked for by name is a UserError naming it; broken tasks among "all" are skipped with a warning."""
    tasks, bad = scan_tasks(root)
    parts = [s.strip() for s in spec.split(",") if s.strip()] if spec != "all" else []
    for part in parts:  # asked for by name, or all of a task's subtasks broken: nothing to skip to
        broken = [n for n in bad if n == part or n.startswith(part + "/")]
        if part in bad or (broken and not any(n == part or n.startswith(part + "/") for n in tasks)):
            raise UserError(f"BIG-bench task {broken[0]}: {bad[broken[0]]}")
    if not tasks:
        raise UserError(f"no multiple-choice tasks under {root}" + (f" ({len(bad)} broken)" if bad else ""))
    if spec == "all":
        _warn_skipped(root, bad)
        return list(tasks)
    names = []
    for part in parts:
        hit = [n for n in tasks if n == part or n.startswith(part + "/")]
        if not hit:
            raise UserError(f"unknown task {part!r}; available: {', '.join(tasks)}")
        _warn_skipped(root, {n: why for n, why in bad.items() if n.startswith(part + "/")})
        names += [n for n in hit if n not in names]
    return names


@dataclass
class Task:
    name: str
    examples: list
    task_prefix: str = ""
    input_prefix: str = "\nQ: "
    output_prefix: str = "\nA: "
    choice_prefix: str = "\n  choice: "
    append_choices: bool = True
    separator: str = "\n"

    @classmethod
    def load(cls, name: str, path: Path) -> "Task":
        try:
            d = read_task(path)
        except BadTask as e:
            raise UserError(f"BIG-bench task {name}: {path} {e}")
        if d is None:
            raise UserError(f"BIG-bench task {name} ({path}) has no multiple-choice examples (target_scores)")
        ex = [e for e in d["examples"] if e.get("target_scores")]
        return cls(name=name, examples=ex, task_prefix=d.get("task_prefix", ""),
                   input_prefix=d.get("example_input_prefix", "\nQ: "),
                   output_prefix=d.get("example_output_prefix", "\nA: "),
                   choice_prefix=d.get("choice_prefix", "\n  choice: "),
                   append_choices=d.get("append_choices_to_input", True),
                   separator=d.get("few_shot_example_separator", "\n"))

    def question(self, ex: dict, rng: random.Random) -> str:
        text = ex["input"]
        if self.append_choices:
            choices = sorted(ex["target_scores"])
            rng.shuffle(choices)
            text = text + self.choice_prefix + self.choice_prefix.join(choices)
        return self.input_prefix + text + self.output_prefix

    @staticmethod
    def answer(ex: dict) -> str:
        ts = ex["target_scores"]
        return max(ts, key=lambda k: ts[k])


@dataclass
class Item:
    context: str
    choices: list  # continuation strings
    gold: list  # indices of the best choices (several when tied)


def make_items(task: Task, shots: int = 5, limit: int | None = None, seed: int = 1234) -> list[Item]:
    """The scored items: for each of the first `limit` examples (in a seeded shuffle), a prompt with
    `shots` other examples solved."""
    rng = random.Random(seed)
    order = list(range(len(task.examples)))
    rng.shuffle(order)
    if limit is not None:
        order = order[:limit]
    items = []
    for i in order:
        ex = task.examples[i]
        others = [j for j in range(len(task.examples)) if j != i]
        demo = [task.examples[j] for j in rng.sample(others, min(shots, len(others)))]
        ctx = task.task_prefix + "".join(task.question(d, rng) + task.answer(d) + task.separator for d in demo)
        ctx += task.question(ex, rng)
        choices = list(ex["target_scores"])
        best = max(ex["target_scores"].values())
        items.append(Item(ctx, choices, [k for k, c in enumerate(choices) if ex["target_scores"][c] == best]))
    return items


# ---- scoring -----------------------------------------------------------------------------------------
def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces go with the continuation; tokens of the whole string, the
    context's tokens split off the front (so merges across the boundary are kept)."""
    n = len(context) - len(context.rstrip(" "))
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    ctx = ctx if whole[:len(ctx)] == ctx else whole[:len(ctx)]
    cont = whole[len(ctx):]
    if not cont:  # the continuation merged into the context's last token: score that token
        ctx, cont = whole[:-1], whole[-1:]
    return list(ctx), list(cont)


@dataclass
class Scored:
    loglik: float
    greedy: bool  # every continuation token was the argmax
    kv: float  # relative KV size of the decoded rows (nan when nothing was decoded)


def score_continuations(model, ctx: list[int], conts: list[list[int]], policy=None, prefill_frac: float = 1.0,
                        max_len: int | None = None, placement: Placement | None = None) -> list[Scored]:
    """Log-likelihood of each continuation after `ctx`, with `policy` (prepared) on the decoded part.
    Continuations of equal length share one batched teacher-forced pass."""
    from ..policy import FullCache
    policy = policy or FullCache()
    placement = placement or Placement()
    max_len = max_len or model.cfg.max_position
    out: list[Scored | None] = [None] * len(conts)
    groups: dict[int, list[int]] = {}
    for i, c in enumerate(conts):
        groups.setdefault(len(c), []).append(i)
    for n, members in groups.items():
        c_ids = ctx[-(max_len - n + 1):] if len(ctx) + n - 1 > max_len else ctx  # keep the end of a long prompt
        if not c_ids:
            raise UserError("a continuation is longer than the model's context")
        p = max(1, min(len(c_ids), round(prefill_frac * len(c_ids))))
        rows = torch.tensor([c_ids + conts[i][:-1] for i in members], dtype=torch.long, device=model.device)
        sess = placement.new_session(model, len(members), rows.shape[1], policy, prompt_len=p)
        try:
            logits = runtime.teacher_forced(model, rows, p, sess)
        finally:
            sess.store.close()
        # logits at position t predict token t+1: the continuation's tokens are predicted from len(c_ids)-1 on
        lp = F.log_softmax(logits[:, len(c_ids) - 1:].float(), dim=-1)
        target = torch.tensor([conts[i] for i in members], dtype=torch.long, device=lp.device)
        tok_lp = lp.gather(-1, target[..., None])[..., 0]
        greedy = (lp.argmax(-1) == target).all(-1)
        kv = sess.stats.overall()
        for j, i in enumerate(members):
            out[i] = Scored(float(tok_lp[j].double().sum()), bool(greedy[j]), kv)
    return out


@torch.inference_mode()
def score_shared_prefill(model, ctx: list[int], conts: list[list[int]], policies: dict,
                         max_len: int | None = None, placement: Placement | None = None) -> dict:
    """Like `score_continuations` with the whole context as prefill, for several policies at once: one
    dense prefill of the context (`eval.fanout`), then each policy's session decodes every choice, one
    batch row per choice (shorter choices are padded at the end: later tokens cannot change earlier
    log-probabilities). Returns name -> [Scored] in the order of `conts`. The relative KV size counts
    the padded steps too."""
    from .fanout import prefill_shared
    max_len = max_len or model.cfg.max_position
    longest = max(len(c) for c in conts)
    if len(ctx) + longest - 1 > max_len:
        ctx = ctx[-(max_len - longest + 1):]
    n = len(conts)
    names = list(policies)
    logits, sessions = prefill_shared(model, torch.tensor([ctx], device=model.device), [policies[k] for k in names],
                                      len(ctx) + longest, repeat=n, placement=placement)
    first = F.log_softmax(logits[0].float(), -1)
    pad = [c + [c[-1]] * (longest - len(c)) for c in conts]
    feed = torch.tensor(pad, dtype=torch.long, device=model.device)  # [n, longest]
    out = {}
    for name, sess in zip(names, sessions):
        lps = [[first[c[0]].item()] for c in conts]
        greedy = [int(first.argmax()) == c[0] for c in conts]
        for t in range(longest - 1):
            lp = F.log_softmax(runtime.decode(model, feed[:, t], sess).float(), -1)
            best = lp.argmax(-1)
            for i, c in enumerate(conts):
                if t + 1 < len(c):
                    lps[i].append(lp[i, c[t + 1]].item())
                    greedy[i] = greedy[i] and int(best[i]) == c[t + 1]
        kv = sess.stats.overall()
        out[name] = [Scored(float(sum(x)), g, kv) for x, g in zip(lps, greedy)]
        sess.store.close()
    return out


def score_item(model, pairs: list[tuple[list[int], list[int]]], policies: dict, prefill_frac: float = 1.0,
               placement: Placement | None = None) -> dict:
    """name -> [Scored] for each (context, continuation) pair; pairs sharing a context are scored together."""
    by_ctx: dict[tuple, list[int]] = {}
    for k, (cx, _) in enumerate(pairs):
        by_ctx.setdefault(tuple(cx), []).append(k)
    out = {n: [None] * len(pairs) for n in policies}
    for cx, ks in by_ctx.items():
        conts = [pairs[k][1] for k in ks]
        if prefill_frac >= 1:
            res = score_shared_prefill(model, list(cx), conts, policies, placement=placement)
        else:
            res = {n: score_continuations(model, list(cx), conts, p, prefill_frac, placement=placement)
                   for n, p in policies.items()}
        for n, scored in res.items():
            for k, r in zip(ks, scored):
                out[n][k] = r
    return out


@dataclass
class TaskResult:
    task: str
    policy: str
    n: int
    acc: float
    acc_norm: float
    agreement: float | None  # predicted choice == the full cache's (None for the full cache itself)
    agreement_norm: float | None
    kv: float  # relative KV size over decoded rows, mean over examples
    predictions: list = field(default_factory=list, repr=False)

    def to_dict(self, with_predictions: bool = False) -> dict:
        d = asdict(self)
        if not with_predictions:
            d.pop("predictions")
        return d


def _argmax(xs):
    return max(range(len(xs)), key=lambda i: xs[i])


def evaluate_task(model, tokenizer, task: Task, policies: dict, shots: int = 5, limit: int | None = None,
                  prefill_frac: float = 1.0, seed: int = 1234, progress=None,
                  placement: Placement | None = None) -> list[TaskResult]:
    """Accuracy of each policy in `policies` (name -> Policy) on `task`, KV pools placed by `placement`;
    the full cache is always scored (agreement is measured against it) and reported first."""
    from ..policies import make_policy
    if not 0 < prefill_frac <= 1:
        raise UserError(f"--prefill-frac must be in (0, 1], got {prefill_frac}")
    pols = dict(policies)
    if "full" not in pols:
        pols = {"full": make_policy("full"), **pols}
    else:
        pols = {"full": pols.pop("full"), **pols}
    pols = {name: p.prepare(model, tokenizer) for name, p in pols.items()}
    items = make_items(task, shots, limit, seed)
    preds = {name: ([], []) for name in pols}
    kvs = {name: [] for name in pols}
    hits = {name: [0, 0] for name in pols}
    for item in items:
        pairs = [encode_pair(tokenizer, item.context, c) for c in item.choices]
        byte_len = [max(1, len(c.encode("utf-8"))) for c in item.choices]
        scored = score_item(model, pairs, pols, prefill_frac, placement)
        for name in pols:
            scores = scored[name]
            ll = [s.loglik for s in scores]
            lln = [s.loglik / b for s, b in zip(scores, byte_len)]
            a, an = _argmax(ll), _argmax(lln)
            preds[name][0].append(a)
            preds[name][1].append(an)
            hits[name][0] += a in item.gold
            hits[name][1] += an in item.gold
            kv_parts = [s.kv for s in scores if not math.isnan(s.kv)]
            if kv_parts:
                kvs[name].append(sum(kv_parts) / len(kv_parts))
        if progress is not None:
            progress(len(pols))
    n = len(items)
    out = []
    full_a, full_an = preds["full"]
    for name in pols:
        a, an = preds[name]
        agree = None if name == "full" else sum(x == y for x, y in zip(a, full_a)) / max(n, 1)
        agree_n = None if name == "full" else sum(x == y for x, y in zip(an, full_an)) / max(n, 1)
        kv = sum(kvs[name]) / len(kvs[name]) if kvs[name] else float("nan")
        out.append(TaskResult(task.name, name, n, hits[name][0] / max(n, 1), hits[name][1] / max(n, 1),
                              agree, agree_n, kv, predictions=list(zip(a, an))))
    return out


def markdown_table(results: list[TaskResult]) -> str:
    lines = ["| task | policy | n | acc | acc_norm | agreement with full | relative KV size |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ag = "-" if r.agreement is None else f"{r.agreement:.3f}"
        kv = "-" if math.isnan(r.kv) else f"{r.kv:.3f}"
        lines.append(f"| {r.task} | {r.policy} | {r.n} | {r.acc:.3f} | {r.acc_norm:.3f} | {ag} | {kv} |")
    return "\n".join(lines)


def summarize(results: list[TaskResult]) -> list[TaskResult]:
    """Mean over tasks per policy (unweighted, as lm-eval's task averages)."""
    by: dict[str, list[TaskResult]] = {}
    for r in results:
        by.setdefault(r.policy, []).append(r)
    out = []
    for name, rs in by.items():
        def mean(xs):
            xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
            return sum(xs) / len(xs) if xs else None
        ag, agn = mean([r.agreement for r in rs]), mean([r.agreement_norm for r in rs])
        kv = mean([r.kv for r in rs])
        out.append(TaskResult("mean", name, sum(r.n for r in rs), mean([r.acc for r in rs]),
                              mean([r.acc_norm for r in rs]), ag, agn, float("nan") if kv is None else kv))
    return out
