"""Native kernels built on first use with torch's cpp_extension into the cache (`cache_dir()/kernels/<name>-<key>`,
keyed by torch's version, the machine, the CPU's flags and the source, so a shared cache never serves a build for
another CPU or another source), one builder at a time; -O3 -march=native and OpenMP (`at::parallel_for`).

Each kernel is built and loaded once per process, whichever thread asks first (`build_native_in_background` starts
the builds while a command converts and loads its model; a caller that needs a kernel meanwhile waits for it). An
interrupted command does not wait for a build in flight: `stop_builds` interrupts its ninja."""
from __future__ import annotations

import fcntl
import hashlib
import math
import os
import platform
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..machine import cpu_flags
from ..paths import writable_cache


def headers(source: Path) -> list[Path]:
    """The headers beside `source` that every kernel may include (`native_common.h`), in a fixed order."""
    return sorted(source.parent.glob("*.h"))


def build_key(source: Path) -> str:
    """A short hash of what a build of `source` depends on (its headers included)."""
    flags = " ".join(sorted(cpu_flags()))
    text = f"{torch.__version__}|{platform.machine()}|{flags}|{source.read_bytes().hex()}"
    for header in headers(source):
        text += f"|{header.name}|{header.read_bytes().hex()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_locks: dict = {}  # name -> the lock its builder holds (each kernel builds beside the others)
_locks_lock = threading.RLock()  # re-entrant: `stop_builds` takes it from a signal handler, maybe inside `load`
_loaded: dict = {}  # name -> the loaded module (True for a library of torch ops), or None where it failed
_building = 0  # builds in flight (under _locks_lock)
_stopping = threading.Event()  # set by stop_builds: no build starts, the one in flight ends without a warning


def load_library(name: str, source: Path) -> bool:
    """Build (once per cache) and load `source`, a library registering torch ops (TORCH_LIBRARY): whether it
    loaded. A failure is one warning line on stderr; the caller keeps its torch path."""
    return load(name, source) is not None


def load(name: str, source: Path, python_module: bool = False):
    """`source` built (once per cache) and loaded (once per process): the extension module where
    `python_module`, else True (a library registering torch ops); None after one warning line on stderr where it
    cannot be built or loaded (the caller keeps its torch path)."""
    with _locks_lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _loaded:
            _loaded[name] = _build(name, source, python_module)
        return _loaded[name]


def loaded(name: str) -> bool:
    """Whether kernel `name` is loaded in this process already (never waits for a build)."""
    return _loaded.get(name) is not None


def stop_builds(wait_s: float = 10.0) -> None:
    """The exit of an interrupted command (Ctrl-C, SIGTERM): the builds in flight stop now instead of holding the
    exit until their compiler finishes (minutes on a busy machine). Their ninja is interrupted, which stops its
    compilers and removes what they half-wrote; the next command builds again. Linux (elsewhere the exit waits)."""
    with _locks_lock:  # a build that has not counted itself yet (`_build`) now sees the stop and does not start
        _stopping.set()
    _interrupt_until_built(time.monotonic() + wait_s)  # a build may be about to start its ninja
    if _building:  # a build slower to start its ninja (a loaded machine): interrupted when it does, as the exit
        threading.Thread(target=_interrupt_until_built, daemon=True, name="infinigen-stop-builds").start()


def _interrupt_until_built(deadline: float = math.inf) -> None:
    """Every ninja of this process interrupted, again and again, until no build is in flight or `deadline` passes
    (`stop_builds`: first while it waits, then on a daemon thread: the exit waits for the builds' threads, not
    for this one)."""
    while _building and time.monotonic() < deadline:
        # ninja passes an interrupt on to its commands once, then waits for them with interrupts blocked: a
        # command's shell that got it while starting runs its compiler on, so every command is interrupted too
        for ninja in _children_named("ninja"):
            for pid in (ninja, *_descendants(ninja)):
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass
        time.sleep(0.05)


def _children(pid: int | str) -> list[int]:
    """A process's children (from /proc: every thread's)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split()]
        except OSError:
            continue
    return found


def _descendants(pid: int) -> list[int]:
    """A process's children, their children, and so on."""
    todo, found = [pid], []
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _children_named(command: str) -> list[int]:
    """This process's child processes running `command`."""
    found = []
    for pid in _children("self"):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == command:
                found.append(pid)
        except OSError:
            pass
    return found


def _build(name: str, source: Path, python_module: bool):
    global _building
    with _locks_lock:
        if _stopping.is_set():
            return None
        _building += 1
    try:
        return _build_now(name, source, python_module)
    finally:
        with _locks_lock:
            _building -= 1


def _build_now(name: str, source: Path, python_module: bool):
    try:
        from torch.utils import cpp_extension

        build = writable_cache(f"kernels/{name}-{build_key(source)}")
        with open(build / "build.flock", "w") as held:
            # a `lock` file of cpp_extension's that a killed builder left would be waited on forever: holding
            # this lock (which the system drops when its holder dies), nobody else is building
            fcntl.flock(held, fcntl.LOCK_EX)
            if _stopping.is_set():  # stopped while another process held the build
                return None
            (build / "lock").unlink(missing_ok=True)
            for header in headers(source):
                _source_in(build, header)
            copy = _source_in(build, source)
            module = cpp_extension.load(
                name=f"infinigen_{name}", sources=[str(copy)], build_directory=str(build),
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=python_module, verbose=False)
        return module if python_module else True
    except Exception as e:  # noqa: BLE001 - any build or load failure means: the torch path
        if _stopping.is_set():
            return None  # stop_builds interrupted it: the command is exiting, it says why itself
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"infinigen: the native {name} kernel is unavailable ({first[:200]}); using torch's", file=sys.stderr)
        return None


def _source_in(build: Path, source: Path) -> Path:
    """The source (or a header) copied into its build folder (keyed by its bytes): every checkout sharing the
    cache names one path in the build's commands, so none rebuilds what another built."""
    copy = build / source.name
    if not copy.is_file() or copy.read_bytes() != source.read_bytes():
        partial = build / f"{source.name}.partial"
        partial.write_bytes(source.read_bytes())
        os.replace(partial, copy)
    return copy
