"""A batch-1 selecting step, this checkout's code against another checkout's (`--base`, e.g. /work/main/src), in ONE
process: both packages imported side by side (the base as `infinigen_base`), each loading the default model,
compiling its step and prefilling the same prompt for InfiniGen (`dense_below=0`: every layer selects) and,
with --full, the full cache; then the steps interleaved A B B A, each step's CPU time on this thread
(`time.thread_time`: a loaded machine's preemption does not inflate it). Also per step: the CPU time inside the
fused selection's native calls (`fused_select.*`), inside `Session.attend` and `Session.event` (the layer's work
between its q/k/v and its attention output, and the hooks), so the Python side of a selecting layer is
(attend + event - native) / layers; and the aten operators one step dispatches.

    PYTHONPATH=src python benchmarks/selecting_python.py --base /work/main/src --length 8176
    PYTHONPATH=src python benchmarks/selecting_python.py --base /work/main/src --length 512 --steps 40
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def load_package(src: str, alias: str):
    """The package `infinigen` found in `src`, imported under the name `alias` (its relative imports stay inside
    it); torch's fake kernels that the first copy registered are not registered again."""
    root = Path(src) / "infinigen"
    spec = importlib.util.spec_from_file_location(alias, root / "__init__.py", submodule_search_locations=[str(root)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


def _register_fake_once():
    original = torch.library.register_fake

    def register_fake(name, *args, **kwargs):
        try:
            return original(name, *args, **kwargs)
        except RuntimeError as e:  # (the other copy registered it: the same op, the same shapes)
            if "already" not in str(e):
                raise
            return args[0] if args else (lambda f: f)
    torch.library.register_fake = register_fake


class Timed:
    """A module's functions wrapped so that the CPU time spent in them adds up in `spent` (this thread)."""

    def __init__(self, module, spent: list):
        self._module, self._spent = module, spent

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        spent = self._spent

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t0
        return timed


class System:
    """One package's model, sessions and instruments."""

    def __init__(self, name: str, pkg_name: str, length: int, full: bool, steps: int):
        self.name = name
        ig = sys.modules[pkg_name] if pkg_name in sys.modules else __import__(pkg_name)
        mod = lambda m: importlib.import_module(f"{pkg_name}.{m}")  # noqa: E731
        self.runtime = mod("runtime")
        side, options, fanout = mod("bench.side_by_side"), mod("commands.options"), mod("eval.fanout")
        policies, self.fused = mod("policies"), mod("kernels.fused_select")
        model, tok, _ = ig.load("default", dtype="auto", weights="auto", progress=False)
        print(name, "compiled:", options.enable_compile(model, "on", long_running=True, rows=[1]) or "no", flush=True)
        tokens = side.staggered_prompts(side.text_ids(tok), length, 1)
        pols = [policies.make_policy("infinigen", calibrate=False, dense_below=0).prepare(model, tok)]
        if full:
            pols.append(policies.make_policy("full"))
        self.logits, self.sessions = fanout.prefill_shared(model, tokens, pols, length + 2 * steps + 16)
        self.model = model
        self.last = [self.logits.argmax(-1)] * len(self.sessions)
        self.native, self.inside = [0.0], [0.0]
        self.times = [[] for _ in self.sessions]
        self.python = []  # ms per selecting step outside the native calls, within attend and event
        self.native_ms = []
        self.tokens = [[] for _ in self.sessions]
        self.instrumented = False

    def instrument(self) -> None:
        """From now on: the CPU time inside the native calls and inside `Session.attend` and `Session.event`."""
        self.instrumented = True
        module = self.fused._module()
        timed = Timed(module, self.native)
        self.fused._module = lambda: timed
        session_cls = self.runtime.Session
        inside = self.inside
        for meth in ("attend", "event"):
            original = getattr(session_cls, meth)

            def wrapped(self_, *args, _original=original, **kwargs):
                t0 = time.thread_time()
                try:
                    return _original(self_, *args, **kwargs)
                finally:
                    inside[0] += time.thread_time() - t0
            setattr(session_cls, meth, wrapped)

    def step(self, i: int) -> None:
        self.native[0] = self.inside[0] = 0.0
        t0 = time.thread_time()
        out = self.runtime.decode(self.model, self.last[i], self.sessions[i])
        if not self.instrumented:
            self.times[i].append((time.thread_time() - t0) * 1e3)
        self.last[i] = out.argmax(-1)
        self.tokens[i].append(int(self.last[i][0]))
        if i == 0 and self.instrumented:
            self.python.append((self.inside[0] - self.native[0]) * 1e3)
            self.native_ms.append(self.native[0] * 1e3)

    def count(self, i: int) -> int:
        with Counter() as c, torch.inference_mode():
            self.last[i] = self.runtime.decode(self.model, self.last[i], self.sessions[i]).argmax(-1)
        return c.calls


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout's src folder")
    ap.add_argument("--length", type=int, default=8176)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per system (the first two not in the median)")
    ap.add_argument("--full", action="store_true", help="the full cache too (each package's)")
    ap.add_argument("--this-first", action="store_true",
                    help="load and prefill this checkout's system first (the order's own bias, measured by swapping)")
    a = ap.parse_args()
    if not Path(a.base, "infinigen", "__init__.py").is_file():
        sys.exit(f"error: no infinigen package in {a.base}")
    torch.set_num_threads(1)
    _register_fake_once()
    import infinigen  # noqa: F401  (this checkout's, from PYTHONPATH)
    load_package(a.base, "infinigen_base")
    made = [("base", "infinigen_base"), ("this", "infinigen")]
    made = [System(name, pkg, a.length, a.full, a.steps) for name, pkg in (made[::-1] if a.this_first else made)]
    systems = sorted(made, key=lambda s: s.name != "base")  # reported base first
    n = len(systems[0].sessions)
    order = [(s, i) for i in range(n) for s in systems]
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip(), flush=True)
    with torch.inference_mode():
        for step in range(a.steps):
            for s, i in (order if step % 2 == 0 else order[::-1]):
                s.step(i)
        for s in systems:
            s.instrument()
        for step in range(max(4, a.steps // 2)):  # (instrumented: not in the step times)
            for s in (systems if step % 2 == 0 else systems[::-1]):
                s.step(0)
    with open("/proc/loadavg") as f:
        print("loadavg", f.read().strip())
    names = ["infinigen dense_below=0", "full cache"]
    layers = systems[0].model.cfg.num_layers
    for i in range(n):
        for s in systems:
            ts = s.times[i][2:]
            print(f"{s.name:5s} {names[i]:24s} ms/step (CPU) median {statistics.median(ts):.2f}  "
                  f"min {min(ts):.2f}  all {[round(x, 1) for x in s.times[i]]}")
        same = systems[0].tokens[i] == systems[1].tokens[i]
        print(f"      {names[i]}: same tokens in both: {same}")
    for s in systems:
        py = statistics.median(s.python[2:])
        print(f"{s.name:5s} selecting step: native calls {statistics.median(s.native_ms[2:]):.2f} ms, python in "
              f"attend+event {py:.2f} ms = {py / layers * 1e3:.0f} us per layer")
    b, t = (statistics.median(s.times[0][2:]) for s in systems)
    print(f"this / base, selecting step: {t / b:.3f}")
    for i in range(n):
        print(names[i], "aten calls per step:", {s.name: s.count(i) for s in systems})


if __name__ == "__main__":
    main()
