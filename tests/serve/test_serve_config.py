"""The server's typed config: each field's bounds are checked where it is declared, naming the flag; a config
that exists is one the server can start with."""
from __future__ import annotations

import dataclasses

import pytest

from infinigen.errors import UserError
from infinigen.serve.config import ServerConfig


@pytest.mark.parametrize("field, value, flag", [
    ("max_batch", 0, "--max-batch"), ("max_queue", -1, "--max-queue"), ("port", 65536, "--port"),
    ("port", -1, "--port"), ("replicas", 0, "--replicas"), ("prefill_chunk_layers", -1, "--prefill-chunk-layers"),
    ("fast_bytes", 0, "--fast-bytes"), ("pool_bytes", 2 ** 63, "--pool-bytes"), ("kv_offload", "ssd", "--kv-offload"),
    ("compile", "sometimes", "--compile"), ("max_batch", 2.5, "--max-batch"), ("max_batch", True, "--max-batch"),
])
def test_a_value_out_of_its_bounds_is_refused_naming_the_flag(field, value, flag):
    with pytest.raises(UserError, match=f"^{flag} "):
        ServerConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("max_batch", 1), ("max_queue", 0), ("port", 0), ("port", 65535),
                                          ("prefill_chunk_layers", 0), ("fast_bytes", 1), ("kv_offload", "disk")])
def test_the_bounds_themselves_are_allowed(field, value):
    assert getattr(ServerConfig(**{field: value}), field) == value


def test_options_that_contradict_each_other_are_refused():
    with pytest.raises(UserError, match="--no-batch-invariant"):
        ServerConfig(compile="on")
    assert ServerConfig(compile="on", batch_invariant=False).compile_mode == "on"
    assert ServerConfig(compile="auto").compile_mode == "off"  # batch-invariant: the step stays eager
    with pytest.raises(UserError, match="needs --prefix-cache-dir"):
        ServerConfig(prefix_cache_dir_bytes=1 << 20)
    with pytest.raises(UserError, match="--no-prefix-cache"):
        ServerConfig(prefix_cache=False, prefix_cache_bytes=1 << 20)


def test_it_is_frozen_and_every_field_says_its_flag_and_what_it_does():
    config = ServerConfig(knobs=["alpha=6"])
    assert config.knobs == ("alpha=6",)  # kept as a tuple: the record is hashable and cannot change
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch = 2
    with pytest.raises(UserError, match="--max-batch"):
        dataclasses.replace(config, max_batch=0)  # a copy is checked as the original was
    described = ServerConfig.describe()
    assert list(described) == [f.name for f in dataclasses.fields(ServerConfig)]
    assert all(line.startswith("--") and len(line.split(": ", 1)[1]) > 10 for line in described.values())
    assert "(>= 1)" in described["max_batch"] and "(>= 0, <= 65535)" in described["port"]
