"""scripts/with_constants.py: module constants overridden for one ketch command (GPU sweeps of
launch parameters through scripts/h200_ab.sh)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import ketch.kernels.norm_gemv as norm_gemv

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "with_constants.py"


def _load():
    spec = importlib.util.spec_from_file_location("with_constants", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_override_is_set_in_the_process_that_runs_the_command(monkeypatch, capsys):
    monkeypatch.setattr(norm_gemv, "PROGRAMS_PER_SM", norm_gemv.PROGRAMS_PER_SM)  # restored after the test
    before = norm_gemv.PROGRAMS_PER_SM
    with pytest.raises(SystemExit) as stop:  # argparse's --help: the command ran, and exited 0
        _load().main([f"ketch.kernels.norm_gemv.PROGRAMS_PER_SM={before + 1}", "--", "bench", "one-batch", "--help"])
    assert stop.value.code == 0
    assert norm_gemv.PROGRAMS_PER_SM == before + 1
    out = capsys.readouterr().out
    assert f"constant ketch.kernels.norm_gemv.PROGRAMS_PER_SM = {before + 1} (was {before})" in out
    assert "--batch-size" in out  # one-batch's usage: the ketch command itself ran


@pytest.mark.parametrize("text, message", [
    ("ketch.kernels.norm_gemv.PROGRAMS_PER_SM", "package.module.NAME=VALUE"),
    ("PROGRAMS_PER_SM=3", "package.module.NAME=VALUE"),
    ("ketch.kernels.norm_gemv.PROGRAMS_PER_SM=three", "Python literal"),
    ("ketch.kernels.norm_gemv.PROGRAMS_PER_SMM=3", "has no PROGRAMS_PER_SMM"),
    ("ketch.kernels.norm_gemv.PROGRAMS_PER_SM=3.0", "is a int, got a float"),
])
def test_a_bad_override_is_refused_naming_it(text, message, monkeypatch):
    monkeypatch.setattr(norm_gemv, "PROGRAMS_PER_SM", norm_gemv.PROGRAMS_PER_SM)
    before = norm_gemv.PROGRAMS_PER_SM
    with pytest.raises(ValueError, match=message):
        _load().apply_override(text)
    assert norm_gemv.PROGRAMS_PER_SM == before


def test_the_command_line_needs_the_separator():
    proc = subprocess.run([sys.executable, str(SCRIPT), "ketch.kernels.norm_gemv.PROGRAMS_PER_SM=3"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "usage: with_constants.py" in proc.stderr
