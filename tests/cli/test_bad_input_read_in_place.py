"""`--read-in-place` on the command line: the GPU reads a pool in pinned host memory, so anything else (no
offload, a disk pool, a CPU device) is one line and exit 2, before the model loads."""
from __future__ import annotations

import pytest

from support.cli import one_line_error


@pytest.mark.parametrize("command", [["generate", "-p", "hi"], ["bench", "--prompt-len", "8", "--gen-len", "2"]])
def test_read_in_place_needs_a_pinned_pool_behind_a_gpu(cli, tiny_checkpoint, no_model_load, command):
    m = [*command, "--model", tiny_checkpoint, "--read-in-place"]
    one_line_error(*cli(*m)[::2], "--read-in-place", "--kv-offload cpu")
    one_line_error(*cli(*m, "--kv-offload", "disk")[::2], "--read-in-place", "--kv-offload disk")
    one_line_error(*cli(*m, "--kv-offload", "cpu", "--device", "cpu")[::2], "--read-in-place", "--device cpu")
