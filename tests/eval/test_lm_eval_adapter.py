"""The lm-evaluation-harness adapter, on hand-made requests (lm_eval's task data is not reachable here)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval", reason="lm_eval is an optional dependency")

from lm_eval.api.instance import Instance  # noqa: E402

from infinigen import runtime
from infinigen.eval.lm_eval_adapter import InfiniGenLM  # noqa: E402
from infinigen.placement import Placement  # noqa: E402


def _req(kind, args, i=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def _ll(model, ids, n_ctx):
    sess = Placement().new_session(model, 1, len(ids))
    lp = F.log_softmax(runtime.prefill(model, torch.tensor([ids]), sess, all_logits=True)[0].float(), -1)
    return sum(lp[t - 1, ids[t]].item() for t in range(n_ctx, len(ids)))


def test_unknown_model_args_are_an_error(checkpoint_model):
    from infinigen.errors import UserError
    model, tok = checkpoint_model
    with pytest.raises(UserError, match="no knob 'alhpa'"):
        InfiniGenLM(model=model, tokenizer=tok, policy="infinigen", alhpa=5)
    lm = InfiniGenLM(model=model, tokenizer=tok, policy="h2o", heavy_ratio=0.2, max_batch_size=None)
    assert lm.policy.heavy_ratio == 0.2


def test_registered():
    from lm_eval.api.registry import get_model
    assert get_model("infinigen") is InfiniGenLM


def test_loglikelihood_full_matches_manual(checkpoint_model):
    model, tok = checkpoint_model
    lm = InfiniGenLM(policy="full", model=model, tokenizer=tok)
    reqs = [_req("loglikelihood", ("The family of Dashwood had long been", c), i)
            for i, c in enumerate([" settled in Sussex.", " a heroine.", " settled"])]
    out = lm.loglikelihood(reqs)
    assert len(out) == 3 and all(isinstance(g, bool) for _, g in out)
    for r, (ll, _) in zip(reqs, out):
        ctx, cont = r.args
        whole = tok(ctx + cont, add_special_tokens=False)["input_ids"]
        n = len(tok(ctx, add_special_tokens=False)["input_ids"])
        assert ll == pytest.approx(_ll(model, whole, n), abs=1e-4)
    assert out[2][0] > out[0][0]  # a prefix of a continuation is more likely than the whole


def test_policy_knobs_and_generation(checkpoint_model):
    model, tok = checkpoint_model
    lm = InfiniGenLM(policy="streaming", model=model, tokenizer=tok, sinks=1, window=2, batch_size="auto")
    assert lm.policy.window == 2 and lm.policy.sinks == 1
    ctx = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    (ll, _), = lm.loglikelihood([_req("loglikelihood", (ctx, ", must be in want of a wife."))])
    full = InfiniGenLM(policy="full", model=model, tokenizer=tok)
    (ll_full, _), = full.loglikelihood([_req("loglikelihood", (ctx, ", must be in want of a wife."))])
    assert math.isfinite(ll) and ll != pytest.approx(ll_full, abs=1e-4)  # the policy acted on the continuation
    rolling = full.loglikelihood_rolling([_req("loglikelihood_rolling", (ctx,))])[0]
    ids = [tok.eos_token_id] + tok(ctx, add_special_tokens=False)["input_ids"]
    assert rolling == pytest.approx(_ll(model, ids, 1), abs=1e-3)
    text, = full.generate_until([_req("generate_until", (ctx, {"until": ["\n"], "max_gen_toks": 8}))])
    assert isinstance(text, str) and "\n" not in text


def test_simple_evaluate_on_a_local_task(checkpoint_model, tmp_path, monkeypatch):
    """lm_eval runs our model type end to end on a task whose data is a local file."""
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    model, tok = checkpoint_model
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in [
        {"question": "The family of Dashwood had long been", "choices": [" settled in Sussex.", " a fox."], "label": 0},
        {"question": "Emma Woodhouse, handsome, clever, and", "choices": [" rich", " blue"], "label": 0}]))
    (tmp_path / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    lm = InfiniGenLM(policy="h2o", model=model, tokenizer=tok, heavy=2, recent=2)
    res = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc"],
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                  num_fewshot=1, log_samples=True)
    # every loglikelihood lm_eval got is ours (the context dense, the choice decoded under H2O), and the
    # accuracy it reports is what those scores give
    from infinigen.eval import fewshot as fs
    from infinigen.policies import make_policy
    pol = make_policy("h2o", heavy=2, recent=2)
    samples = res["samples"]["tiny_mc"]
    assert len(samples) == 2
    hits = 0
    for smp in samples:
        lls = []
        for (ctx, cont), ((ll, greedy),) in zip(smp["arguments"], smp["resps"], strict=True):
            cx, ct = fs.encode_pair(tok, ctx, cont)
            mine = fs.score_continuations(model, cx, [ct], pol)[0]
            assert ll == pytest.approx(mine.loglik, abs=1e-4) and greedy == mine.greedy
            lls.append(mine.loglik)
        hits += lls.index(max(lls)) == smp["doc"]["label"]
    assert res["results"]["tiny_mc"]["acc,none"] == hits / 2
