"""The one reader of /proc/cpuinfo: the CPU's name and flags from its first processor's block."""
from __future__ import annotations

import pytest

from infinigen import machine

CPUINFO = """processor\t: 0
model name\t: Example CPU @ 2.0GHz
flags\t\t: fpu sse2 avx512_bf16 amx_tile

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    def write(text: str | None):
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(machine, "CPUINFO", str(path))
        machine._cpuinfo.cache_clear()
    yield write
    machine._cpuinfo.cache_clear()


def test_name_and_flags_come_from_the_first_processor(cpuinfo):
    cpuinfo(CPUINFO)
    assert machine.cpu_name() == "Example CPU @ 2.0GHz"
    assert machine.cpu_flags() == {"fpu", "sse2", "avx512_bf16", "amx_tile"}


def test_an_unreadable_cpuinfo_knows_no_flags_and_names_the_cpu_otherwise(cpuinfo, monkeypatch):
    cpuinfo(None)
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    assert machine.cpu_flags() == frozenset() and machine.cpu_name() == "unknown"


def test_the_precision_choice_reads_the_flags_here(cpuinfo, monkeypatch):
    """Without torch's own probes, bfloat16 is native where the flags say AVX512-BF16 or AMX."""
    import torch

    from infinigen import precision
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    for text, native in ((CPUINFO, True), (CPUINFO.replace(" avx512_bf16 amx_tile", ""), False)):
        cpuinfo(text)
        precision._cpu_has_bf16.cache_clear()
        assert precision._cpu_has_bf16() is native
    precision._cpu_has_bf16.cache_clear()
