"""A command interrupted while a native kernel builds exits now: its ninja is interrupted (and with it the
compiler), the build ends without a warning line, and nothing waits for the minutes a cold build takes on a busy
machine. The build here is a ninja whose one command sleeps for an hour, and every wait is far shorter than that
and far longer than a loaded machine needs."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infinigen.kernels import native_build
from support.cli import console, subprocess_env

pytestmark = pytest.mark.skipif(shutil.which("ninja") is None or not Path("/proc/self/task").is_dir(),
                                reason="needs ninja and Linux's /proc")

SLOW_BUILD = """
import subprocess
from pathlib import Path
import torch.utils.cpp_extension as cpp_extension

def slow_load(name, sources, build_directory, **kw):  # a build that takes an hour
    Path(build_directory, "build.ninja").write_text("rule wait\\n  command = sleep 3600\\nbuild never: wait\\n")
    subprocess.run(["ninja", "-C", build_directory], check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

cpp_extension.load = slow_load
"""


def _wait_until(condition, timeout: float = 900) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _slow_load():
    """SLOW_BUILD's `slow_load`: a cpp_extension.load whose ninja sleeps for an hour."""
    namespace: dict = {}
    exec(SLOW_BUILD, namespace)
    return namespace["slow_load"]


def _build_on_a_thread(tmp_path, monkeypatch, load, name: str):
    """A fresh native_build state with `load` as cpp_extension's, and a thread building kernel `name` with it ->
    (the thread, started; the list its result goes to; the source it builds)."""
    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    monkeypatch.setenv("INFINIGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_build, "_stopping", threading.Event())
    monkeypatch.setattr(native_build, "_loaded", {})
    source = tmp_path / f"{name}.cpp"
    source.write_text("// built by a ninja that sleeps\n")
    got = []
    builder = threading.Thread(target=lambda: got.append(native_build.load(name, source)))
    builder.start()
    return builder, got, source


def test_stop_builds_ends_a_build_in_flight(tmp_path, monkeypatch, capsys):
    """`stop_builds` interrupts the ninja of the build in flight: the building thread returns None (the torch
    path) within seconds, prints nothing, its compiler is gone, and no later build starts."""
    builder, got, source = _build_on_a_thread(tmp_path, monkeypatch, _slow_load(), "slow")
    try:
        assert _wait_until(lambda: native_build._children_named("ninja")), "the build's ninja never started"
        ninja = native_build._children_named("ninja")[0]
        native_build.stop_builds()
        builder.join(timeout=900)
        assert not builder.is_alive(), "the build still runs after stop_builds"
    finally:
        for pid in native_build._children_named("ninja"):
            subprocess.run(["kill", "-9", str(pid)])
        builder.join(timeout=60)
    assert got == [None]
    assert not Path(f"/proc/{ninja}").exists() or "Z" in Path(f"/proc/{ninja}/stat").read_text().split()[2]
    assert native_build.load("another", source) is None  # stopping: nothing builds any more
    assert capsys.readouterr().err == ""


def test_a_build_starting_its_ninja_after_the_stop_is_interrupted_too(tmp_path, monkeypatch, capsys):
    """A build in flight that starts its ninja only after `stop_builds` stopped waiting (a loaded machine, its
    ninja late): that ninja is interrupted as it starts, so the building thread, which the exit waits for, ends
    within seconds, not after the hour its build would take."""
    slow_load, started, go = _slow_load(), threading.Event(), threading.Event()

    def late_load(*args, **kw):  # in flight (counted) before the stop; its ninja only after the stop's wait
        started.set()
        go.wait(60)
        slow_load(*args, **kw)
    builder, got, _ = _build_on_a_thread(tmp_path, monkeypatch, late_load, "late")
    try:
        assert started.wait(900), "the build never started"
        native_build.stop_builds(wait_s=0.2)  # returns before the ninja exists
        assert builder.is_alive() and not native_build._children_named("ninja")
        go.set()
        builder.join(timeout=120)
        assert not builder.is_alive(), "the late ninja was not interrupted"
    finally:
        go.set()
        for pid in native_build._children_named("ninja"):
            subprocess.run(["kill", "-9", str(pid)])
        builder.join(timeout=60)
    assert got == [None]
    assert capsys.readouterr().err == ""


def test_a_command_that_missed_ninjas_interrupt_while_starting_is_interrupted_too(tmp_path, monkeypatch, capsys):
    """ninja passes an interrupt on to its commands once and then waits for them with interrupts blocked; a command
    whose shell got it while starting (here: ignoring it for its first two seconds) then runs its compiler on (here:
    an hour's sleep). `stop_builds` interrupts ninja's commands too, again and again, so the build ends within
    seconds of the command's start, not after the hour."""
    def deaf_load(name, sources, build_directory, **kw):
        command = "sh -c 'trap \"\" INT; sleep 2; trap - INT; exec sleep 3600'"
        Path(build_directory, "build.ninja").write_text(f"rule wait\n  command = {command}\nbuild never: wait\n")
        subprocess.run(["ninja", "-C", build_directory], check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    builder, got, _ = _build_on_a_thread(tmp_path, monkeypatch, deaf_load, "deaf")
    try:
        assert _wait_until(lambda: native_build._children_named("ninja")), "the build's ninja never started"
        native_build.stop_builds()
        builder.join(timeout=120)
        assert not builder.is_alive(), "the command that missed ninja's interrupt still runs"
    finally:
        for pid in native_build._children_named("ninja"):
            for p in (pid, *native_build._descendants(pid)):
                subprocess.run(["kill", "-9", str(p)])
        builder.join(timeout=60)
    assert got == [None]
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_kernels_build_exits_at_once(tiny_checkpoint, tmp_path, sig, code):
    """`infinigen serve` starts the weight kernels' build while it loads its model; a signal while that build
    runs exits (130 after Ctrl-C, 0 after SIGTERM) within seconds, with no warning about the kernel."""
    script = SLOW_BUILD + "import sys\nfrom infinigen.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    argv = console("serve", "--model", tiny_checkpoint, "--port", 0, "--compile", "off", "--max-batch", 1)[1:]
    if argv[:2] == ["-m", "infinigen.cli"]:
        argv = argv[2:]
    env = subprocess_env(INFINIGEN_CACHE=str(tmp_path / "cache"))
    p = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert _wait_until(lambda: any(_comm(c) == "ninja" for c in native_build._descendants(p.pid)), timeout=900), \
            "the kernels' build never started"
        p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=900)  # the build alone would take 3600 s
        except subprocess.TimeoutExpired:
            pytest.fail("the command waited for the kernels' build after the signal")
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == code, err
    assert "Traceback" not in err and "unavailable" not in err
    assert ("interrupted" in err) == (sig == signal.SIGINT)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
