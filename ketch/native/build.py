"""Compile ketch's C kernels once per machine and load them with ctypes.

The source is plain C (no torch headers: a build takes ~1 s, not the ~40 s of a torch extension),
built with the system C compiler for the widest instruction set this machine allows, and kept in
the user's cache keyed by the source (with the headers beside it), the compiler and the flags:

    $XDG_CACHE_HOME/ketch/native/<name>-<isa>-<hash>.so

Parallel loops use OpenMP: the library names `libgomp.so.1`, which resolves to the copy torch has
already loaded, so both share one thread pool (two pools would spin against each other on the
same cores). No compiler, a failed build or `KETCH_NATIVE_CPU=0`: `load` returns None and the
callers keep torch's kernels.

The instruction set (`isa()`): avx512vnni, avx2 or generic, the best the CPU has, lowered by the
variables that emulate a smaller machine (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2...`)
so that an emulated run is one; `KETCH_NATIVE_ISA` picks one outright (tests run each).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ketch.user_cache import user_cache_dir

HERE = Path(__file__).parent
ISAS = ("generic", "avx2", "avx512vnni")  # widest last
FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
}
COMMON = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno"]
ISA_CODE = {"generic": 1, "avx2": 2, "avx512vnni": 3}  # what a built library's `*_isa()` returns


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> str:
    """The instruction set the kernels are built for (module docstring)."""
    asked = os.environ.get("KETCH_NATIVE_ISA", "")
    if asked:
        if asked not in ISAS:
            raise ValueError(f"KETCH_NATIVE_ISA must be one of {', '.join(ISAS)}, got {asked!r}")
        return asked
    flags = _cpu_flags()
    best = "generic"
    if {"avx2", "fma", "f16c"} <= flags:
        best = "avx2"
    if best == "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        best = "avx512vnni"
    emulated_avx2 = (os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default")
                     or os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith(("AVX2", "SSE")))
    if emulated_avx2 and best == "avx512vnni":
        best = "avx2"
    return best


def enabled() -> bool:
    return os.environ.get("KETCH_NATIVE_CPU", "1") != "0"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path(name: str, which: str) -> Path | None:
    """Where the built `name.c` for `which` lives (built or not); None without a compiler."""
    cc = _compiler()
    if cc is None:
        return None
    sources = [(HERE / f"{name}.c").read_bytes()] + [h.read_bytes() for h in sorted(HERE.glob("*.h"))]
    key = b"\0".join([*sources, _compiler_version(cc).encode(), " ".join(COMMON + FLAGS[which]).encode()])
    return user_cache_dir("native", f"{name}-{which}-{hashlib.sha256(key).hexdigest()[:16]}.so")


def _build(name: str, which: str, out: Path) -> None:
    """Compile to a temporary file beside `out`, then rename: processes building at once (an API
    and an engine process, several servers) each end with a whole library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([_compiler(), *COMMON, *FLAGS[which], str(HERE / f"{name}.c"), "-o", tmp, "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def load(name: str, which: str | None = None) -> ctypes.CDLL | None:
    """The built library `name` for `which` (default: `isa()`, else the narrower ones in turn, for
    a compiler too old for the CPU), compiled on first use; None when native kernels are off or
    none can be built here."""
    if not enabled():
        return None
    if which is None:
        best = isa()
        for narrower in reversed(ISAS[: ISAS.index(best) + 1]):
            lib = load(name, narrower)
            if lib is not None:
                return lib
        return None
    path = library_path(name, which)
    if path is None:
        return None
    try:
        if not path.exists():
            _build(name, which, path)
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # a damaged file in the cache: build it again, once
            _build(name, which, path)
            return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError):
        return None
