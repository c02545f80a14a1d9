"""The measured 4-bit crossovers (int4_crossover.py), kept per machine so that later start-ups
reuse them: no timing at start (0.7-4 s), and the same choice, hence the same bf16 rounding,
on every start of every replica on this machine, instead of one that may move near a tie.

    $XDG_CACHE_HOME/ketch/int4_crossover/<key>.json   {"OUTxIN": tokens, ...}

The key is everything the timing depends on: the 4-bit kernel (torch's or ketch's, and the
instruction set it was built for), the CPU model, torch's version and the ISA it
dispatches to (with ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY / MKL_ENABLE_INSTRUCTIONS (MKL's fp32
GEMM: linear.dense_in_fp32), which emulate other machines),
the thread count, the dtype and the set of shapes. Only a clean measurement is stored: one whose
repeated timings agree (int4_crossover.Timing.noisy); a start-up under load measures for itself
and keeps nothing. A file that cannot be read, or lacks a shape, is measured again and replaced.
`KETCH_INT4_CROSSOVER=measure` measures (and stores) whatever the cache holds; a token count pins
the crossover without reading or writing it (int4_crossover.pinned_tokens).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from ketch.user_cache import user_cache_dir

FORMAT = 2  # of the key and the file; a change of either bumps it
Shape = tuple[int, int]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(shapes: list[Shape], dtype: torch.dtype, kernel: str = "torch") -> Path:
    key = "|".join(map(str, (
        FORMAT, kernel, _cpu_model(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""), os.environ.get("ATEN_CPU_CAPABILITY", ""),
        os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        torch.get_num_threads(), dtype, sorted(shapes))))
    return user_cache_dir("int4_crossover", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def load(shapes: list[Shape], dtype: torch.dtype, kernel: str = "torch") -> dict[Shape, int] | None:
    """The stored crossover of every shape, or None (absent, unreadable, incomplete, or re-measure asked)."""
    if os.environ.get("KETCH_INT4_CROSSOVER") == "measure":
        return None
    try:
        raw = json.loads(cache_path(shapes, dtype, kernel).read_text())
        found = {(int(o), int(i)): int(n) for (o, i), n in ((k.split("x"), v) for k, v in raw.items())}
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return found if set(found) == set(shapes) and all(n >= 0 for n in found.values()) else None


def store(found: dict[Shape, int], dtype: torch.dtype, kernel: str = "torch") -> None:
    """Written whole or not at all (a temporary file renamed); a read-only cache is not an error."""
    path = cache_path(list(found), dtype, kernel)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            tmp = f.name
            json.dump({f"{o}x{i}": n for (o, i), n in sorted(found.items())}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
