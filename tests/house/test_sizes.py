"""Rooms a newcomer can carry: no module of the package over 600 lines, no function over 80, except those named
here (each with why); an exception is taken off the list once it is split."""
from __future__ import annotations

import ast
from pathlib import Path

import infinigen

PACKAGE = Path(infinigen.__file__).parent
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80

LONG_FILES: dict[str, str] = {}
LONG_FUNCTIONS: dict[str, str] = {}


def _functions(tree: ast.AST):
    """(qualified name, lines) of every function, methods and nested functions included."""
    todo = [(tree, "")]
    while todo:
        node, prefix = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child.end_lineno - child.lineno + 1
                todo.append((child, prefix + child.name + "."))
            elif isinstance(child, ast.ClassDef):
                todo.append((child, prefix + child.name + "."))


def _sizes():
    files, functions = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        text = path.read_text(encoding="utf-8")
        files[name] = len(text.splitlines())
        for fn, lines in _functions(ast.parse(text)):
            functions[f"{name}:{fn}"] = lines
    return files, functions


def test_no_file_and_no_function_is_longer_than_a_reader_can_follow():
    files, functions = _sizes()
    long_files = sorted(f"{n} ({k} lines)" for n, k in files.items() if k > MAX_FILE_LINES and n not in LONG_FILES)
    long_functions = sorted(f"{n} ({k} lines)" for n, k in functions.items()
                            if k > MAX_FUNCTION_LINES and n not in LONG_FUNCTIONS)
    assert not long_files, f"files over {MAX_FILE_LINES} lines: " + ", ".join(long_files)
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long_functions)


def test_every_exception_still_names_something_that_exists():
    files, functions = _sizes()
    assert set(LONG_FILES) <= set(files) and set(LONG_FUNCTIONS) <= set(functions)
