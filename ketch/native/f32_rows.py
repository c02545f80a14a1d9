"""Python face of f32_rows.c: x @ W^T (+ bias) in fp32 for steps of up to MAX_ROWS rows, W streamed
once, each row's result independent of the batch it is in (bit for bit).

`make_linear(fallback)` is the fp32 CPU model's dense product (`LayerOps.linear`, layers/ops.py):
the C product for the steps it takes, `fallback` (torch's F.linear) for everything else: more
rows (a prefill: the BLAS's GEMM is compute-bound there and wins), other dtypes, a weight that is
not one contiguous fp32 matrix, and calls inside a `torch.compile` graph.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ketch.native import build

# Up to here the C product streams W at the 1-row speed; MKL's sgemm halves from 4 rows on. Past
# 8 rows the GEMM's compute-bound blocking starts to pay (docs/performance.md has the sweep).
MAX_ROWS = 8
_i64, _p = ctypes.c_int64, ctypes.c_void_p
Dense = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def library() -> ctypes.CDLL | None:
    """The built library, when it has a vector loop for this machine (the generic build has none)."""
    lib = build.load("f32_rows")
    if lib is None:
        return None
    if lib.ketch_f32_rows_linear.argtypes is None:  # declared once per library
        lib.ketch_f32_rows_isa.restype = ctypes.c_int
        lib.ketch_f32_rows_linear.argtypes = [_p, _i64, _p, _p, _p, _i64, _i64, _i64, ctypes.c_int]
        lib.ketch_f32_rows_linear.restype = None
    return lib if lib.ketch_f32_rows_isa() >= 2 else None


def available() -> bool:
    return library() is not None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the C product runs this call (module docstring)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu"
            and x.stride(1) == 1 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.is_contiguous() and weight.shape[1] == x.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()
                                  and bias.shape == (weight.shape[0],)))
            and not torch.compiler.is_compiling())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ weight[N, K]^T (+ bias) -> [M, N]; the caller checked `takes`."""
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    library().ketch_f32_rows_linear(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                    None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, x.shape[1],
                                    torch.get_num_threads())
    return y


def make_linear(fallback: Dense) -> Dense:
    def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, weight, bias) if takes(x, weight, bias) else fallback(x, weight, bias)
    return dense
