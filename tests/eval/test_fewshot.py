"""Few-shot log-likelihood scoring: formatting, lm-eval token split, exact scores, policies, CLI."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from infinigen import runtime
from infinigen.eval import fewshot as fs
from infinigen.eval.policyset import parse_policies
from infinigen.policies import make_policy
from infinigen.placement import Placement

TASK = {
    "task_prefix": "Answer yes or no.\n",
    "example_input_prefix": "\nQ: ",
    "example_output_prefix": "\nA: ",
    "append_choices_to_input": False,
    "examples": [{"input": f"Is {i} even?", "target_scores": {"yes": float(i % 2 == 0), "no": float(i % 2 == 1)}}
                 for i in range(12)],
}


@pytest.fixture
def task_dir(tmp_path):
    (tmp_path / "parity").mkdir()
    (tmp_path / "parity" / "task.json").write_text(json.dumps(TASK))
    sub = tmp_path / "fruit" / "easy"
    sub.mkdir(parents=True)
    (tmp_path / "fruit" / "task.json").write_text(json.dumps({"name": "fruit", "description": "x"}))
    (sub / "task.json").write_text(json.dumps({"examples": [
        {"input": f"Fruit number {i}?", "target_scores": {"the apple": 1, "the pear": 0, "a long banana": 0}}
        for i in range(6)]}))
    return tmp_path


def test_tasks_and_items(task_dir):
    tasks = fs.list_tasks(task_dir)
    assert set(tasks) == {"parity", "fruit/easy"}
    assert fs.resolve_tasks("fruit", task_dir) == ["fruit/easy"]
    assert fs.resolve_tasks("all", task_dir) == list(tasks)
    with pytest.raises(Exception):
        fs.resolve_tasks("nope", task_dir)
    t = fs.Task.load("parity", tasks["parity"])
    items = fs.make_items(t, shots=3, limit=5, seed=7)
    assert len(items) == 5
    for it in items:
        assert it.context.startswith("Answer yes or no.\n")
        assert it.context.count("\nQ: ") == 4 and it.context.endswith("\nA: ")
        question = it.context.rsplit("\nQ: ", 1)[1]
        n = int(question.split()[1])
        assert it.choices == ["yes", "no"] and it.gold == [0 if n % 2 == 0 else 1]
        # the shots are other examples, answered correctly
        for shot in it.context.split("\nQ: ")[1:-1]:
            m = int(shot.split()[1])
            assert m != n and shot.split("\nA: ")[1].strip() == ("yes" if m % 2 == 0 else "no")
    # default BIG-bench formatting appends the choices to the input
    fruit = fs.Task.load("fruit/easy", tasks["fruit/easy"])
    ctx = fs.make_items(fruit, shots=1, limit=1)[0].context
    assert "\n  choice: " in ctx and "a long banana" in ctx


def test_encode_pair_moves_trailing_space(tiny_tokenizer):
    ctx, cont = fs.encode_pair(tiny_tokenizer, "The answer is: ", "the apple")
    whole = tiny_tokenizer("The answer is: the apple", add_special_tokens=False)["input_ids"]
    assert ctx + cont == whole
    assert tiny_tokenizer.decode(cont).startswith(" ")


def _manual_loglik(model, ctx, cont):
    sess = Placement().new_session(model, 1, len(ctx) + len(cont))
    logits = runtime.prefill(model, torch.tensor([ctx + cont]), sess, all_logits=True)[0]
    lp = F.log_softmax(logits.float(), -1)
    return sum(lp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_full_cache_scores_are_exact(make_tiny):
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(3, 250, (20,), generator=g).tolist()
    conts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (1, 3, 3, 5)]
    got = fs.score_continuations(model, ctx, conts)
    for s, c in zip(got, conts):
        assert s.loglik == pytest.approx(_manual_loglik(model, ctx, c), abs=1e-4)
    # a decoded tail of the prompt changes nothing for the full cache
    half = fs.score_continuations(model, ctx, conts, make_policy("full"), prefill_frac=0.5)
    for a, b in zip(half, got):
        assert a.loglik == pytest.approx(b.loglik, abs=1e-4)
    assert half[1].kv == pytest.approx(1.0)


def test_policy_changes_scores_only_on_decoded_rows(make_tiny):
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(3, 250, (40,), generator=g).tolist()
    conts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (1, 6)]
    pol = make_policy("streaming", sinks=1, window=3)
    full = fs.score_continuations(model, ctx, conts)
    small = fs.score_continuations(model, ctx, conts, pol)
    assert small[0].loglik == pytest.approx(full[0].loglik, abs=1e-5)  # one token: from the dense prompt
    assert small[1].loglik != pytest.approx(full[1].loglik, abs=1e-3)
    assert small[1].kv < 0.2
    tail = fs.score_continuations(model, ctx, conts, pol, prefill_frac=0.5)
    assert tail[0].loglik != pytest.approx(full[0].loglik, abs=1e-4)


def test_shared_prefill_equals_teacher_forced(make_tiny):
    """The evaluation shortcut (one dense prefill for every policy and choice, then decoding) scores
    exactly what teacher-forced mode with the context as prefill scores."""
    _, model = make_tiny("llama")
    g = torch.Generator().manual_seed(2)
    ctx = torch.randint(3, 250, (30,), generator=g).tolist()
    conts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (1, 4, 4, 7)]
    pols = parse_policies("full,streaming,h2o,int4", ["streaming.window=3", "streaming.sinks=1", "h2o.heavy=3",
                                                      "h2o.recent=2"])
    pols["infinigen"] = make_policy("infinigen", skew=False, dense_layers=(), alpha=1.0)
    shared = fs.score_shared_prefill(model, ctx, conts, pols)
    longest = max(map(len, conts))
    padded = [c + [c[-1]] * (longest - len(c)) for c in conts]  # what shared decoding feeds every row
    for name, pol in pols.items():
        ref = fs.score_continuations(model, ctx, conts, pol)
        for a, b in zip(shared[name], ref):
            assert a.loglik == pytest.approx(b.loglik, abs=1e-4), name
            assert a.greedy == b.greedy
        # the relative KV size counts the padded steps of shorter choices too: it is the teacher-forced
        # size of the padded choices, read by every row at every step
        kv = fs.score_continuations(model, ctx, padded, pol)[0].kv
        assert all(s.kv == pytest.approx(kv, abs=1e-6) for s in shared[name]), (name, kv, shared[name][0].kv)
    assert shared["full"][0].kv == 1 and shared["streaming"][0].kv < 0.2  # 4 of 30..35 entries


def test_evaluate_task_agreement(task_dir, tiny_checkpoint):
    from infinigen import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    t = fs.Task.load("fruit/easy", fs.list_tasks(task_dir)["fruit/easy"])
    pols = parse_policies("full,streaming", ["streaming.sinks=1", "streaming.window=2"])
    res = fs.evaluate_task(model, tok, t, pols, shots=2, limit=4, prefill_frac=0.5)
    assert [r.policy for r in res] == ["full", "streaming"]
    full, st = res
    assert full.n == 4 == st.n and full.agreement is None
    # the aggregates, recomputed item by item from each choice's own teacher-forced score
    picks, kvs = {"full": [], "streaming": []}, {"full": [], "streaming": []}
    items = fs.make_items(t, shots=2, limit=4, seed=1234)
    for it in items:
        pairs = [fs.encode_pair(tok, it.context, c) for c in it.choices]
        nbytes = [len(c.encode("utf-8")) for c in it.choices]
        for name, pol in pols.items():
            sc = [fs.score_continuations(model, cx, [ct], pol, prefill_frac=0.5)[0] for cx, ct in pairs]
            ll = [s.loglik for s in sc]
            picks[name].append((ll.index(max(ll)), max(range(len(ll)), key=lambda i: ll[i] / nbytes[i])))
            kvs[name].append(sum(s.kv for s in sc) / len(sc))
    for r in res:
        mine = picks[r.policy]
        assert r.predictions == mine
        assert r.acc == sum(a in it.gold for (a, _), it in zip(mine, items)) / 4
        assert r.acc_norm == sum(an in it.gold for (_, an), it in zip(mine, items)) / 4
        assert r.kv == pytest.approx(sum(kvs[r.policy]) / 4, abs=1e-6)
    assert st.agreement == sum(x[0] == y[0] for x, y in zip(picks["streaming"], picks["full"])) / 4
    assert st.agreement_norm == sum(x[1] == y[1] for x, y in zip(picks["streaming"], picks["full"])) / 4
    assert full.kv == 1 and st.kv < 0.5
    # the same policy object as "full" under another name agrees perfectly
    again = fs.evaluate_task(model, tok, t, {"full": make_policy("full"), "dense": make_policy("full")},
                             shots=2, limit=4)
    assert again[1].agreement == 1.0 and again[1].acc == again[0].acc
    table = fs.markdown_table(res + fs.summarize(res))
    assert "| fruit/easy | streaming | 4 |" in table and "| mean |" in table


def test_evaluate_task_aggregates(task_dir, tiny_tokenizer, monkeypatch):
    """acc, acc_norm, agreement and the relative KV size from designed scores where the policies disagree
    (the tiny random model predicts the same choice for every item, whatever the policy)."""
    t = fs.Task.load("fruit/easy", fs.list_tasks(task_dir)["fruit/easy"])  # choices: apple, pear, banana; gold 0
    nan = float("nan")
    full = [([-1, -2, -3], [1, 1, 1])] * 4  # picks apple (per byte: -1/9 > -3/13 > -2/8)
    streaming = [([-1, -2, -3], [0.1, 0.1, 0.1]),  # apple, apple
                 ([-3, -1, -2], [0.2, 0.4, nan]),  # pear, pear (per byte -1/8 > -2/13 > -3/9)
                 ([-2, -2.1, -2.5], [nan, nan, nan]),  # apple; per byte banana (-2.5/13 > -2/9 > -2.1/8)
                 ([-1, -2, -3], [0.5, 0.5, 0.5])]
    calls = []

    def score_item(model, pairs, policies, prefill_frac, placement=None):
        assert len(pairs) == 3 and prefill_frac == 0.5
        k = len(calls)
        calls.append(k)
        return {n: [fs.Scored(ll, False, kv) for ll, kv in zip(*table[k])]
                for n, table in (("full", full), ("streaming", streaming)) if n in policies}
    monkeypatch.setattr(fs, "score_item", score_item)
    res = fs.evaluate_task(None, tiny_tokenizer, t, {"streaming": make_policy("streaming")}, shots=1, limit=4,
                           prefill_frac=0.5)
    f, st = res
    assert len(calls) == 4 and [r.policy for r in res] == ["full", "streaming"]
    assert (f.acc, f.acc_norm, f.agreement, f.kv) == (1.0, 1.0, None, 1.0)
    assert st.predictions == [(0, 0), (1, 1), (0, 2), (0, 0)]
    assert (st.acc, st.acc_norm, st.agreement, st.agreement_norm) == (0.75, 0.5, 0.75, 0.5)
    assert st.kv == pytest.approx((0.1 + 0.3 + 0.5) / 3)  # nan parts left out; an all-nan item too


def test_parse_policies_knobs():
    pols = parse_policies("full,h2o,streaming", ["h2o.heavy_ratio=0.05", "window=8"])
    assert pols["h2o"].heavy_ratio == 0.05 and pols["streaming"].window == 8
    with pytest.raises(Exception):
        parse_policies("full", ["window=8"])
    with pytest.raises(Exception):
        parse_policies("full,nope")


def test_cli_fewshot(task_dir, tiny_checkpoint, tmp_path, capsys):
    from infinigen.cli import main
    out = tmp_path / "r.json"
    rc = main(["fewshot", "--model", str(tiny_checkpoint), "--data", str(task_dir), "--task", "all", "--shots", "2",
               "--limit", "3", "--policy", "full,streaming", "--knob", "window=2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| parity | streaming | 3 |" in text and "| mean | full |" in text
    data = json.loads(out.read_text())
    assert len(data["results"]) == 4
    assert main(["fewshot", "--model", str(tiny_checkpoint), "--data", str(task_dir), "--shots", "-1"]) == 2
    assert main(["fewshot", "--data", str(task_dir), "--task", "nope"]) == 2


@pytest.mark.integration
def test_default_model_fewshot(default_model):
    model, tok = default_model
    root = fs.find_root()
    t = fs.Task.load("analytic_entailment", fs.list_tasks(root)["analytic_entailment"])
    res = fs.evaluate_task(model, tok, t, {"h2o": make_policy("h2o")}, shots=5, limit=4)
    assert [r.policy for r in res] == ["full", "h2o"]
    assert all(0 <= r.acc <= 1 for r in res) and 0 <= res[1].agreement <= 1
    assert not math.isnan(res[1].kv) and res[1].kv < 1
    random.seed(0)
