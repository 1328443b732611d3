"""The tests' own rule: no test module imports another test module or a conftest.py. pytest imports those
itself, once per folder; what tests share lives in tests/support/ (functions) or a conftest.py (fixtures)."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported(path: Path):
    """The top-level names of the modules `path` imports anywhere in its code (absolute imports only)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module.partition(".")[0]


def test_no_test_imports_a_test_module_or_a_conftest():
    found = [f"{p.relative_to(TESTS)} imports {name}" for p in sorted(TESTS.rglob("*.py"))
             for name in _imported(p) if name.startswith("test_") or name == "conftest"]
    assert not found, "move what they share to tests/support/ or a conftest.py fixture:\n" + "\n".join(found)
