"""Helpers shared by the kernel wrappers (host side only: nothing here runs per element)."""
from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter), where bf16 math is not trustworthy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact products ("ieee"), not TF32: fp32 is the reference mode and its
    tests compare against torch at fp32 tolerances. bf16/fp16 ignore this and use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels take every stride but the last; a strided last dim is copied once."""
    return x if x.stride(-1) == 1 else x.contiguous()
