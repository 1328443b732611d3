"""The command line's tests' fixtures."""
from __future__ import annotations

import importlib

import pytest


@pytest.fixture(scope="module", autouse=True)
def _commands_imported():
    """Import every command module before `no_model_load` patches `basic.load_model`: a module imported
    while it is patched would keep the patched function after the test."""
    from infinigen.cli import build_app
    build_app()


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model fails the test: the error had to come before it."""
    import infinigen.commands.basic as basic

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was noticed")
    # the command modules are imported before anything is patched: a module first imported under the patch
    # would bind the stub in its `from .basic import load_model` and keep it after the test (the next test
    # in this worker would then "load the model before the bad input" with a valid input)
    commands = [importlib.import_module(f"infinigen.commands.{mod}")
                for mod in ("ppl", "fewshot", "needle", "analyze", "skew")]
    monkeypatch.setattr(basic, "load_model", refuse)
    for m in commands:
        if hasattr(m, "load_model"):
            monkeypatch.setattr(m, "load_model", refuse)
