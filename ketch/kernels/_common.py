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


_early: bool | None = None  # KETCH_PDL_EARLY, resolved with the PDL switch
_sm_count: int | None = None


def early_trigger_enabled() -> bool:
    """On by default (KETCH_PDL_EARLY=0 turns it off): small latency-bound kernels whose grid
    fits in one wave call gdc_launch_dependents before their gdc_wait, so the kernel after them
    launches, and requests its first weight tile (gemv, head_gemv), while they and the kernel
    before them still run. Correctness does not change: every kernel still waits for its
    predecessor's completion before it reads or stores anything a step writes. Measured
    (H100, bs1 decode, same-run A/B, docs/performance.md run 78): 0.2-1.3 % faster on
    DeepSeek-V2-Lite, Qwen3-30B-A3B and Llama-3.1-8B, slower on none."""
    global _early
    if _early is None:
        _early = use_pdl() and os.environ.get("KETCH_PDL_EARLY", "1") != "0"
    return _early


def sm_count() -> int:
    """The current GPU's SM count (read once)."""
    global _sm_count
    if _sm_count is None:
        _sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return _sm_count


def one_wave(programs: int) -> bool:
    """Whether `programs` CTAs fit on the GPU's SMs at one CTA each: then the dependents that
    launch early take only SMs this grid leaves idle."""
    return programs <= sm_count()


def pdl_launch(programs: int | None = None) -> dict[str, bool]:
    """Launch kwargs of every PDL-aware kernel: the constexpr that compiles the gdc_wait /
    gdc_launch_dependents calls in, and Triton's launch option (cuLaunchKernelEx with
    programmatic stream serialization). The interpreter ignores launch_pdl. `programs`: the
    grid's size, for the kernels with an EARLY_TRIGGER constexpr (early_trigger_enabled)."""
    on = use_pdl()
    kw = {"USE_PDL": on, "launch_pdl": on}
    if programs is not None:
        kw["EARLY_TRIGGER"] = on and early_trigger_enabled() and one_wave(programs)
    return kw


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products ("ieee"), not TF32: fp32 is the reference mode and its
    tests compare against torch at fp32 tolerances. bf16/fp16 ignore this and use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take every stride but the last; a strided last dim is copied once."""
    return x if x.stride(-1) == 1 else x.contiguous()
