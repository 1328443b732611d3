"""The disk tier's pool folder and block layout on the command line: a bad value is one line and exit 2,
before the model loads, nothing left behind."""
from __future__ import annotations

from support.cli import one_line_error


def test_cli_bad_pool_folder_before_loading(cli, tiny_checkpoint, tmp_path, no_model_load):
    """A pool folder that cannot hold a file (a file in its place, under /proc, under a file) or a block
    layout off the disk tier or below 0."""
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    m = ["generate", "-p", "hi", "--model", tiny_checkpoint, "--kv-offload", "disk", "--disk-block", "16"]
    one_line_error(*cli(*m, "--pool-dir", a_file)[::2], str(a_file))
    one_line_error(*cli(*m, "--pool-dir", "/proc/infinigen-kv")[::2], "/proc/infinigen-kv")
    one_line_error(*cli(*m, "--pool-dir", a_file / "sub")[::2], str(a_file / "sub"))
    one_line_error(*cli("generate", "-p", "hi", "--model", tiny_checkpoint, "--disk-block", "16")[::2],
                   "--disk-block", "disk")
    one_line_error(*cli(*m[:-1], "-3")[::2], "--disk-block")
    assert a_file.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
