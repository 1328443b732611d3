"""The benchmarks/ scripts loaded as modules (they are not a package), one per test module."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from support.cli import REPO


def _script(name: str):
    """benchmarks/<name>.py as a module, registered while the tests use it."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the script is being run
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def peer():
    """benchmarks/peer_llamacpp.py"""
    yield from _script("peer_llamacpp")


@pytest.fixture(scope="module")
def sl():
    """benchmarks/serve_load.py"""
    yield from _script("serve_load")


@pytest.fixture(scope="module")
def block_accuracy():
    """benchmarks/disk_block_accuracy.py"""
    yield from _script("disk_block_accuracy")


@pytest.fixture(scope="module")
def serve_disk():
    """benchmarks/serve_disk.py"""
    yield from _script("serve_disk")
