"""One composition root: the engine's parts are built in ketch/engine/build.py and nowhere else in
ketch (the TP workers build their own rank's runner the same way: tp_worker.py), so a new part
(a host tier, a transfer engine, a proposer) is wired in one place."""
from __future__ import annotations

import ast
import pathlib

import ketch

PARTS = {"ModelRunner", "KVCacheManager", "Scheduler", "GrammarGate", "TensorParallelRanks"}
ALLOWED = {
    "engine/build.py": PARTS,
    "engine/tp_worker.py": {"ModelRunner"},  # rank k > 0 builds its own runner in its own process
}


def constructions(root: pathlib.Path) -> dict[str, set[str]]:
    """file (relative to ketch/) -> the part classes it calls."""
    out: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in PARTS:
                    name = func.value.id  # a named constructor: KVCacheManager.from_config(...)
                else:
                    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
                if name in PARTS:
                    out.setdefault(str(path.relative_to(root)), set()).add(name)
    return out


def test_engine_parts_are_built_only_in_the_composition_root():
    found = constructions(pathlib.Path(ketch.__file__).parent)
    stray = {f: names - ALLOWED.get(f, set()) for f, names in found.items() if names - ALLOWED.get(f, set())}
    assert not stray, f"engine parts built outside ketch/engine/build.py: {stray}"
    assert found["engine/build.py"] == PARTS


def test_a_stray_construction_is_seen(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "engine.py").write_text("from x import Scheduler\nS = Scheduler(config, kv)\n")
    assert constructions(tmp_path) == {"engine/engine.py": {"Scheduler"}}
