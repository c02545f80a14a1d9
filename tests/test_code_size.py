"""Small files with one idea each (issue 14): no file of ketch over 400 lines, and no function of
the engine core (engine/, scheduler/, cache/, runner/) over 60 lines."""
from __future__ import annotations

import ast
import pathlib

import ketch

ROOT = pathlib.Path(ketch.__file__).parent
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
CORE = ("engine", "scheduler", "cache", "runner")


def long_files(root: pathlib.Path) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}


def long_functions(root: pathlib.Path) -> dict[str, int]:
    out = {}
    for package in CORE:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        out[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = lines
    return out


def test_no_file_over_400_lines():
    assert long_files(ROOT) == {}


def test_no_core_function_over_60_lines():
    assert long_functions(ROOT) == {}


def test_the_checks_see_a_long_file_and_a_long_function(tmp_path):
    (tmp_path / "engine").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "engine" / "big.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE_LINES)
    for package in CORE[1:]:
        (tmp_path / package).mkdir()
    assert list(long_files(tmp_path)) == ["engine/big.py"]
    assert long_functions(tmp_path) == {"engine/big.py:1 f": MAX_FUNCTION_LINES + 1}
