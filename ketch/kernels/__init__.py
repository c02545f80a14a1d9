"""Triton kernels, each next to the torch reference it is tested against (see README.md)."""
from ketch.kernels._common import interpreting
from ketch.kernels._interpret_compat import (
    patch_interpreter_fp8_rounding,
    patch_interpreter_scalar_index,
)

if interpreting():
    patch_interpreter_scalar_index()
    patch_interpreter_fp8_rounding()
