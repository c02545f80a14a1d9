"""Whether this CPU runs bf16 matmuls natively: the CPU's default model dtype (config.py) and the
4-bit path's check (runner/model_runner.py) read it."""
from __future__ import annotations

import functools
import os

# oneDNN's instruction-set caps below AVX512_CORE_BF16: a process told to act as such a machine
_ONEDNN_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"})


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively, so bf16 is the fast CPU default. Not when
    the variables that emulate a smaller machine cap the instruction set below them
    (`ONEDNN_MAX_CPU_ISA=AVX2`, `ATEN_CPU_CAPABILITY=avx2`): an emulated run then chooses as that
    machine would (ketch/native/build.py reads the same variables)."""
    if (os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_WITHOUT_BF16
            or os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("avx2", "default")):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
