"""Fixes to Triton 3.6's CPU interpreter (compiled kernels never see them).

- numpy >= 2.4: the interpreter keeps scalars as 1-element arrays and turns them into loop
  bounds with int(array), which numpy 2.4 refuses. Newer Triton squeezes first; so does this.
- fp8 e4m3 stores: its float -> float8e4nv conversion adds the rounding carry to the mantissa
  bits with an OR, so a value that rounds up across a power of two loses that power (-124.5 ->
  -64, not -128; ~9% of random values differ from torch) and subnormals round wrongly. The GPU
  converts in hardware (cvt.rn.satfinite, round to nearest even); torch's conversion is the
  same, so this routes those conversions through torch.
"""
from __future__ import annotations

import numpy as np
import torch


def patch_interpreter_scalar_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_ketch_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._ketch_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def patch_interpreter_fp8_rounding() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "_ketch_patched", False):
        return
    as_torch = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}
    nearest = (None, interpreter._ir.ROUNDING_MODE.RTNE)

    def patched(input, input_dtype, output_dtype, rounding_mode):  # type: ignore[no-untyped-def]
        if output_dtype != tl.float8e4nv or input_dtype not in as_torch or rounding_mode not in nearest:
            return original(input, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(input)).view(as_torch[input_dtype])  # bf16 arrives as uint16
        return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)

    patched._ketch_patched = True  # type: ignore[attr-defined]
    interpreter._convert_float = patched
