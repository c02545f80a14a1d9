"""scripts/mutation_check.py: its mutations still apply (every run), and each is caught (slow,
a few minutes: KETCH_MUTATION_CHECK=1)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mutation_check.py"


def _load():
    """The script as a module (scripts/ is not a package); registered first, as dataclasses need."""
    if "mutation_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["mutation_check"] = module
        spec.loader.exec_module(module)
    return sys.modules["mutation_check"]


@pytest.mark.parametrize("name", [m.name for m in _load().MUTATIONS])
def test_the_mutation_still_applies(name):
    """Code that moved under a mutation must take the mutation along, or it checks nothing."""
    mc = _load()
    [m] = [m for m in mc.MUTATIONS if m.name == name]
    assert mc.applies(m) is None, mc.applies(m)
    for test in m.tests:
        assert (SCRIPT.parent.parent / test.split("::")[0]).is_file(), test


@pytest.mark.skipif(os.environ.get("KETCH_MUTATION_CHECK") != "1", reason="slow; set KETCH_MUTATION_CHECK=1")
def test_every_planted_bug_is_caught():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
