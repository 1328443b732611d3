"""The Python API answers like the CLI: `infinigen.generate` takes one prompt or many, checks its arguments and
sampling settings in one line (`UserError`), and prepares a policy given by name as `make_policy` would."""
from __future__ import annotations

import math

import pytest

from support.cli import REPO


# ---- prompts, arguments, sampling, policies by name ------------------------------------------------------------------
def test_python_generate_prompts(checkpoint_model):
    import infinigen
    model, tok = checkpoint_model
    empty = infinigen.generate(model, tok, [], max_new_tokens=4)
    assert empty.texts == [] and empty.tokens == [] and empty.prompt_tokens == 0
    one = infinigen.generate(model, tok, "Hello there", max_new_tokens=4)
    listed = infinigen.generate(model, tok, ["Hello there"], max_new_tokens=4)
    assert len(one.texts) == 1 and one.tokens == listed.tokens
    assert len(infinigen.generate(model, tok, ("a b", "c d"), max_new_tokens=2).texts) == 2


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompts=None), "prompts"), (dict(prompts=["hi", None]), "prompt 1"), (dict(prompts=b"hi"), "prompts"),
    (dict(sampling="greedy"), "sampling"), (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=None), "max_new_tokens"), (dict(policy=42), "policy"), (dict(policy="nope"), "nope"),
])
def test_python_generate_bad_arguments(checkpoint_model, kwargs, needle):
    import infinigen
    from infinigen.errors import UserError
    model, tok = checkpoint_model
    args = dict(prompts=["hi"], max_new_tokens=2) | kwargs
    with pytest.raises(UserError, match=needle) as e:
        infinigen.generate(model, tok, args.pop("prompts"), **args)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
                                         ("top_p", math.nan), ("top_p", math.inf), ("top_k", 1.5), ("seed", -1),
                                         ("seed", 2 ** 64), ("temperature", "hot")])
def test_python_sampling_is_checked(checkpoint_model, field, value):
    import infinigen
    from infinigen.errors import UserError
    model, tok = checkpoint_model
    with pytest.raises(UserError, match=field) as e:
        infinigen.generate(model, tok, ["hi"], max_new_tokens=2, sampling=infinigen.Sampling(**{field: value}))
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0  # one sentence


def test_python_policy_by_name(checkpoint_model, tmp_path, monkeypatch):
    """`policy="infinigen"` is `make_policy("infinigen")`, prepared (its skew matrices calibrated) the same way."""
    import infinigen
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("INFINIGEN_DATA", str(REPO / "src" / "infinigen" / "data"))  # the bundled calibration text
    model, tok = checkpoint_model
    by_name = infinigen.generate(model, tok, ["It is a truth universally"], max_new_tokens=6, policy="infinigen")
    by_object = infinigen.generate(model, tok, ["It is a truth universally"], max_new_tokens=6,
                                   policy=infinigen.make_policy("infinigen"))
    assert by_name.tokens == by_object.tokens and len(by_name.tokens[0]) == 6
    assert list((tmp_path / "cache" / "skew").glob("*.safetensors"))  # calibrated, as make_policy's would be
    assert len(infinigen.generate(model, tok, ["It is a truth"], max_new_tokens=3, policy="h2o").tokens[0]) == 3
