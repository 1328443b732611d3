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


def test_reading_in_place_is_the_default_only_where_it_is_not_refused():
    """Unset, the flag leaves reading in place on (in effect only where the GPU can read the pool); only an explicit
    `--read-in-place` is checked against the tier and device; `--no-read-in-place` turns it off anywhere."""
    from infinigen.bench import BenchSettings
    from infinigen.commands.placement_opts import check_read_in_place
    from infinigen.errors import UserError
    from infinigen.placement import Placement

    assert Placement().read_in_place and BenchSettings(prompt_lens=[8], batch_sizes=[1], gen_len=2).read_in_place
    assert check_read_in_place(None, "none", "cpu") is True and check_read_in_place(None, "disk", "cuda") is True
    assert check_read_in_place(False, "cpu", "cuda") is False and check_read_in_place(True, "cpu", "cuda:0") is True
    with pytest.raises(UserError):
        check_read_in_place(True, "cpu", "cpu")
