"""The package's floors (ARCHITECTURE.md): every import of an `infinigen` module, at module level or inside a
function, points to the same floor or a lower one, and no modules import each other in a circle."""
from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import infinigen

PACKAGE = Path(infinigen.__file__).parent

# lowest first; a module's floor is the first pattern it matches
FLOORS = [
    ("ground", ["errors", "config", "codecs", "selection", "memory", "paths", "sizes", "membound", "machine",
                "precision", "sparsity", "kernels", "kernels.*"]),
    ("stores and the policy interface", ["cache", "pool", "policy"]),
    ("network", ["model", "checkpoints", "quantized", "gguf_model", "loading"]),
    ("step", ["runtime", "runtime.*", "compiled", "compiled_parts"]),
    ("placement", ["placement", "placement.*"]),
    ("calibration", ["skew"]),
    ("methods", ["policies", "policies.*"]),
    ("users", ["generate", "eval", "eval.*", "bench", "bench.*", "hf", "serve", "serve.*"]),
    ("commands", ["commands", "commands.*", "cli"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:  # the package itself is a facade of lazy names
            out[name] = p
    return out


def _floor(name: str) -> int:
    for i, (_, patterns) in enumerate(FLOORS):
        if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
            return i
    raise AssertionError(f"infinigen.{name} has no floor in tests/house/test_floors.py")


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The infinigen modules `name` imports anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
                base = ".".join(base)
            elif (node.module or "").startswith("infinigen"):
                base = node.module.removeprefix("infinigen").lstrip(".")
            else:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                found.add(full if full in modules else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("infinigen.") for a in node.names if a.name.startswith("infinigen.")}
    return {m for m in found if m in modules and m != name}


def test_imports_point_down_and_go_in_no_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    up = [f"{m} ({FLOORS[_floor(m)][0]}) imports {t} ({FLOORS[_floor(t)][0]})"
          for m, targets in graph.items() for t in targets if _floor(t) > _floor(m)]
    assert not up, "imports that run up a floor:\n" + "\n".join(sorted(up))
    # a circle within a floor: depth-first search for a back edge
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in graph[m]:
            assert state.get(t) != 1, "import circle: " + " -> ".join(path + [t])
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert _floor("model") < _floor("runtime") < _floor("placement") and "policies" not in str(graph["model"])
    # every module of policies/ is a method's: what the runtime and calibration need of a policy (its
    # interface, the attention statistics) lives below them, so neither imports anything from policies/
    assert all(_floor(m) == _floor("policies") for m in modules if m.startswith("policies"))
    assert not {t for m in ("runtime", "skew") for t in graph[m] if t.startswith("policies")}
