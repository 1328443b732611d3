"""A memory bound for benchmarks, so that the page cache cannot hold a disk-tier KV pool.

Without it, a "disk" row on a machine with free RAM measures the page cache: the pool file is written
once and every later read is a memory copy. A memory cgroup charges the page cache of the files its
processes touch, so with a limit below the pool size the kernel must evict pool pages and read them
again from the device. Mechanisms, the first that works:

  cgroup2      a fresh group with memory.max (and memory.swap.max 0) on the unified hierarchy
  cgroup1      a fresh group with memory.limit_in_bytes on the v1 memory hierarchy
  systemd-run  `systemd-run --scope -p MemoryMax=` around a command (when systemd runs)

Where none works, MemoryBound raises a UserError saying why (dropping the pool's pages from the disk tier
with posix_fadvise, the last resort, is not built yet: mapped pages need madvise(MADV_PAGEOUT) first).

Root is needed for the cgroups. Every result states the mechanism and the limit (`MemoryBound.describe`).

    with MemoryBound(2 << 30) as mb:           # a group; nothing is in it yet
        rc = mb.run([sys.executable, "-m", "infinigen.cli", "bench", ...])
        mb.enter()                             # or: this process from now on (page cache charged from here)
        mb.leave()
        print(mb.describe(), mb.stats())
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import UserError
from .sizes import parse_bytes

MECHANISMS = ("cgroup2", "cgroup1", "systemd-run")
_count = itertools.count()


def _mounts():
    with open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts = line.split()[:4]
            yield mnt, fstype, opts.split(",")


def _own_path(controller: str | None) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` (None: the unified one)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _systemd() -> bool:
    return shutil.which("systemd-run") is not None and os.path.isdir("/run/systemd/system")


class MemoryBound:
    """A memory limit of `limit` bytes. `mechanism`: "auto" (the first of MECHANISMS that works) or one of them."""

    def __init__(self, limit: int, mechanism: str = "auto"):
        if limit < 1 << 20:
            raise UserError(f"a memory limit must be at least 1 MiB, got {limit} bytes")
        if mechanism != "auto" and mechanism not in MECHANISMS:
            raise UserError(f"unknown memory bound {mechanism!r}; choose auto or {', '.join(MECHANISMS)}")
        self.limit = int(limit)
        self.group: Path | None = None  # the cgroup directory
        self.home: Path | None = None  # where enter() took this process from
        self.mechanism = None
        self.why: list[str] = []  # why earlier mechanisms were passed over
        for m in MECHANISMS if mechanism == "auto" else (mechanism,):
            try:
                getattr(self, "_make_" + m.replace("-", "_"))()
                self.mechanism = m
                break
            except (OSError, RuntimeError) as e:
                self.why.append(f"{m}: {e}")
        if self.mechanism is None:
            raise UserError(f"cannot bound memory: {'; '.join(self.why)}")

    # ---- making the group ---------------------------------------------------------------------------
    def _name(self) -> str:
        return f"infinigen-bound-{os.getpid()}-{next(_count)}"

    def _make_cgroup2(self) -> None:
        root = next((Path(m) for m, t, _ in _mounts() if t == "cgroup2"), None)
        if root is None:
            raise RuntimeError("no cgroup2 mount")
        if "memory" not in (root / "cgroup.controllers").read_text().split():
            raise RuntimeError(f"the memory controller is not on the unified hierarchy ({root})")
        own = root / (_own_path(None) or "/").lstrip("/")
        # a group's own processes forbid enabling controllers for its children ("no internal
        # processes"), except at the root: try our own group first, then the root
        for parent in dict.fromkeys((own, root)):
            try:
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    _write(parent / "cgroup.subtree_control", "+memory")
                group = parent / self._name()
                group.mkdir()
                break
            except OSError as e:
                self.why.append(f"cgroup2 under {parent}: {e}")
        else:
            raise RuntimeError("no cgroup2 parent with the memory controller is writable")
        self.group, self._root = group, root
        try:
            _write(group / "memory.max", str(self.limit))
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")  # evicted anonymous pages must not hide in swap
        except OSError:
            self.close()
            raise

    def _make_cgroup1(self) -> None:
        root = next((Path(m) for m, t, o in _mounts() if t == "cgroup" and "memory" in o), None)
        if root is None:
            raise RuntimeError("no cgroup v1 memory hierarchy")
        parent = root / (_own_path("memory") or "/").lstrip("/")
        group = parent / self._name()
        group.mkdir()
        self.group, self._root = group, root
        try:
            _write(group / "memory.limit_in_bytes", str(self.limit))
            if (group / "memory.memsw.limit_in_bytes").exists():
                try:
                    _write(group / "memory.memsw.limit_in_bytes", str(self.limit))  # no swap either
                except OSError:
                    pass
        except OSError:
            self.close()
            raise

    def _make_systemd_run(self) -> None:
        if not _systemd():
            raise RuntimeError("systemd-run not found or systemd is not running")

    # ---- using it ------------------------------------------------------------------------------------
    def describe(self) -> str:
        mib = f"{self.limit / 2**20:.0f} MiB"
        return {"cgroup2": f"cgroup v2 memory.max = {mib} ({self.group})",
                "cgroup1": f"cgroup v1 memory.limit_in_bytes = {mib} ({self.group})",
                "systemd-run": f"systemd-run --scope -p MemoryMax={self.limit} ({mib})"}[self.mechanism]

    def info(self) -> dict:
        """For tables and JSON."""
        return {"mechanism": self.mechanism, "limit_bytes": self.limit, "describe": self.describe()}

    def _procs(self) -> Path:
        return self.group / "cgroup.procs"

    def run(self, argv: list[str], env: dict | None = None, **popen_kw) -> int:
        """Run `argv` inside the bound; returns its exit code."""
        env = dict(os.environ if env is None else env)
        if self.mechanism == "systemd-run":
            argv = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={self.limit}", "-p", "MemorySwapMax=0",
                    "--", *argv]
            return subprocess.run(argv, env=env, **popen_kw).returncode
        procs = str(self._procs())

        def join():  # in the child, before exec: everything it touches is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return subprocess.run(argv, env=env, preexec_fn=join, **popen_kw).returncode

    def enter(self) -> None:
        """Move this process into the group: memory it touches from now on is charged to it (what it holds
        already stays charged where it was)."""
        if self.group is None:
            raise UserError(f"{self.mechanism} can only bound a command, not a running process")
        self.home = self._root / (_own_path(None if self.mechanism == "cgroup2" else "memory") or "/").lstrip("/")
        _write(self._procs(), str(os.getpid()))

    def leave(self) -> None:
        if self.home is not None:
            _write(self.home / "cgroup.procs", str(os.getpid()))
            self.home = None

    def stats(self) -> dict:
        """Bytes charged now, the peak, and the page cache part (file pages) of the group."""
        if self.group is None:
            return {}
        g = self.group
        stat = dict(line.split() for line in (g / "memory.stat").read_text().splitlines())
        if self.mechanism == "cgroup2":
            peak = g / "memory.peak"
            return {"current": int((g / "memory.current").read_text()),
                    "peak": int(peak.read_text()) if peak.exists() else None, "file": int(stat["file"])}
        return {"current": int((g / "memory.usage_in_bytes").read_text()),
                "peak": int((g / "memory.max_usage_in_bytes").read_text()), "file": int(stat["cache"])}

    def close(self) -> None:
        if self.home is not None:
            self.leave()
        if self.group is not None and self.group.exists():
            if self.mechanism == "cgroup1" and (self.group / "memory.force_empty").exists():
                try:
                    _write(self.group / "memory.force_empty", "0")  # give the cached pages back first
                except OSError:
                    pass
            try:
                self.group.rmdir()
            except OSError as e:
                print(f"infinigen: could not remove {self.group}: {e}", file=sys.stderr)
        self.group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def parse_limit(text: str) -> int | None:
    """'auto' -> None (the caller decides), '0'/'none'/'off' -> 0 (no bound), else a size like 2G or 512M."""
    t = text.strip().lower()
    if t == "auto":
        return None
    if t in ("0", "none", "off"):
        return 0
    return parse_bytes(t, "memory-limit")


BOUND_ENV = "INFINIGEN_MEMORY_BOUND"  # set in a re-executed command: the bound it runs under (JSON)


def command_args(ctx) -> list[str]:
    """The command line of a click/typer command, rebuilt from its parsed parameters (to re-run it)."""
    args = []
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is None or not getattr(p, "opts", None) or p.param_type_name != "option":
            continue
        if getattr(p, "is_flag", False):
            if getattr(p, "secondary_opts", None):
                args.append(p.opts[0] if v else p.secondary_opts[0])
            elif v:
                args.append(p.opts[0])
        elif getattr(p, "multiple", False):
            for x in v:
                args += [p.opts[0], str(x)]
        else:
            args += [p.opts[0], str(v)]
    return args


def _build_kernels_first() -> None:
    """The native kernels built (or found in the cache) before the bound: a compiler needs more memory than a
    bound sized for the run leaves, and the bounded run then only loads the build."""
    from .kernels import build_native
    build_native()


def rerun_bounded(ctx, module_argv: list[str], limit: int) -> int:
    """Re-run this CLI command (`python -m infinigen.cli <module_argv> <its options>`) inside a memory
    bound; the child finds the bound's description in BOUND_ENV. Returns the child's exit code."""
    import json
    with MemoryBound(limit) as mb:
        _build_kernels_first()  # in this process, outside the bound its child joins
        print(f"infinigen: running under {mb.describe()}", file=sys.stderr, flush=True)
        env = dict(os.environ, **{BOUND_ENV: json.dumps(mb.info())})
        code = mb.run([sys.executable, "-m", "infinigen.cli", *module_argv, *command_args(ctx)], env=env)
        if mb.group is not None:
            print(f"infinigen: memory bound peak {mb.stats()['peak'] / 2**20:.0f} MiB", file=sys.stderr)
    return code


UNLIMITED = 1 << 60  # a cgroup's "no limit" reads as a number near 2^63 (v1) or "max" (v2)


def cgroup_limit() -> int | None:
    """The memory limit this process runs under: the tightest limit of its memory cgroup and the groups above
    it (v2 memory.max, v1 memory.limit_in_bytes); None where there is none or none can be read."""
    limits = []
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup2":
            own, name = _own_path(None), "memory.max"
        elif fstype == "cgroup" and "memory" in opts:
            own, name = _own_path("memory"), "memory.limit_in_bytes"
        else:
            continue
        if own is None:
            continue
        group = Path(mnt) / own.lstrip("/")
        while True:
            try:
                text = (group / name).read_text().strip()
            except OSError:
                text = "max"
            if text.isdigit() and int(text) < UNLIMITED:
                limits.append(int(text))
            if group == Path(mnt):
                break
            group = group.parent
    return min(limits) if limits else None


def popen_bounded(mb: MemoryBound, argv: list[str], env: dict) -> subprocess.Popen:
    """Start `argv` inside the bound, in a session of its own (signals reach it only through the caller)."""
    if mb.mechanism == "systemd-run":
        argv = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={mb.limit}", "-p", "MemorySwapMax=0",
                "--", *argv]
        return subprocess.Popen(argv, env=env, start_new_session=True)
    procs = str(mb._procs())

    def join():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    return subprocess.Popen(argv, env=env, preexec_fn=join, start_new_session=True)


def serve_bounded(ctx, module_argv: list[str], limit: int) -> int:
    """Like `rerun_bounded`, for a long-running command: SIGINT and SIGTERM sent to this process are passed on
    to the bounded child, which decides what they mean; returns the child's exit code once it ends."""
    import json
    import signal
    with MemoryBound(limit) as mb:
        _build_kernels_first()  # in this process, outside the bound its child joins
        print(f"infinigen: running under {mb.describe()}", file=sys.stderr, flush=True)
        env = dict(os.environ, **{BOUND_ENV: json.dumps(mb.info())})
        child = popen_bounded(mb, [sys.executable, "-m", "infinigen.cli", *module_argv, *command_args(ctx)], env)

        def forward(sig, frame):
            child.send_signal(sig)

        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if child.poll() is None:
                child.kill()
                child.wait()


def current() -> dict | None:
    """The bound this process runs under (set by rerun_bounded), or None."""
    import json
    text = os.environ.get(BOUND_ENV)
    return json.loads(text) if text else None
