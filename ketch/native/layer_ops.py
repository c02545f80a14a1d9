"""Python faces of layer_ops.c: RMSNorm (+ residual add) and RoPE on bf16 CPU rows, each one C
call. `ketch.layers.ops.native_ops()` builds a LayerOps from them for a bf16 model on the CPU;
a call whose tensors the C code does not take (another dtype, a strided row) runs `fallback`,
the torch op of the same contract, and so does a call inside a `torch.compile` graph
(`--cpu-compile`: inductor fuses those ops itself).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ketch.native import build

_i64, _p, _f = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "ketch_rms_norm_bf16": [_p, _p, _p, _i64, _i64, _f],
    "ketch_add_rms_norm_bf16": [_p, _p, _p, _p, _p, _i64, _i64, _f],
    "ketch_rotary_bf16": [_p, _p, _p, _i64, _i64, _i64, _i64],
}


def library() -> ctypes.CDLL | None:
    lib = build.load("layer_ops")
    if lib is not None and lib.ketch_rms_norm_bf16.argtypes is None:  # declared once per library
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = None
    return lib


def available() -> bool:
    return library() is not None


def _rows(*ts: torch.Tensor) -> bool:
    """Whether the C code takes these: bf16 CPU tensors, rows contiguous, outside a compiled graph."""
    return not torch.compiler.is_compiling() and all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in ts)


def make_rms_norm(fallback: Callable) -> Callable:
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _rows(x, weight) or x.dim() != 2:
            return fallback(x, weight, eps)
        y = torch.empty_like(x)
        library().ketch_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y
    return rms_norm


def make_add_rms_norm(fallback: Callable) -> Callable:
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not _rows(x, residual, weight) or x.dim() != 2 or x.shape != residual.shape:
            return fallback(x, residual, weight, eps)
        y, s = torch.empty_like(x), torch.empty_like(x)
        library().ketch_add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), y.data_ptr(),
                                          s.data_ptr(), x.shape[0], x.shape[1], eps)
        return y, s
    return add_rms_norm


def make_rotary(fallback: Callable) -> Callable:
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place (LayerOps allows it): x [tokens, heads, dim], heads contiguous within a token
        (a view of the fused qkv rows); cos / sin [tokens, 1, dim]."""
        t, heads, dim = x.shape
        if (not _rows(cos, sin) or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.stride(2) != 1
                or x.stride(1) != dim or cos.shape != (t, 1, dim) or sin.shape != (t, 1, dim)):
            return fallback(x, cos, sin)
        library().ketch_rotary_bf16(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, dim, x.stride(0))
        return x
    return rotary
