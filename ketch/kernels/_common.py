"""Helpers shared by the kernel wrappers (host side only: nothing here runs per element)."""
from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter), where bf16 math is not trustworthy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl_enabled(*, interpreting: bool, cuda_available: bool, capability: tuple[int, int] | None,
                disable_env: str | None) -> bool:
    """Programmatic dependent launch (Hopper+ griddepcontrol): on for compiled kernels on a GPU
    of compute capability >= 9.0 unless KETCH_DISABLE_PDL=1 (A/B runs). Off in the interpreter
    and on the CPU, where the kernels then compile exactly as without PDL."""
    if interpreting or not cuda_available or capability is None or disable_env == "1":
        return False
    return tuple(capability) >= (9, 0)


_pdl: bool | None = None  # resolved once, at the first launch (tests may set it)


def use_pdl() -> bool:
    """The process-wide switch. Resolved lazily rather than at import so that importing the
    kernels never initialises CUDA (CPU tests, the engine's parent process)."""
    global _pdl
    if _pdl is None:
        cuda = torch.cuda.is_available()
        _pdl = pdl_enabled(interpreting=interpreting(), cuda_available=cuda,
                           capability=torch.cuda.get_device_capability() if cuda else None,
                           disable_env=os.environ.get("KETCH_DISABLE_PDL"))
    return _pdl


def pdl_launch() -> dict[str, bool]:
    """Launch kwargs of every PDL-aware kernel: the constexpr that compiles the gdc_wait /
    gdc_launch_dependents calls in, and Triton's launch option (cuLaunchKernelEx with
    programmatic stream serialization). The interpreter ignores launch_pdl."""
    on = use_pdl()
    return {"USE_PDL": on, "launch_pdl": on}


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products ("ieee"), not TF32: fp32 is the reference mode and its
    tests compare against torch at fp32 tolerances. bf16/fp16 ignore this and use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take every stride but the last; a strided last dim is copied once."""
    return x if x.stride(-1) == 1 else x.contiguous()
