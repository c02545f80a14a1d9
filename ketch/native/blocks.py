"""Calling a block-quantized product of ketch's C code (block_common.h's driver): `ketch_<name>_matmul`
of library `<name>_matmul`, for q4 (4-bit GGUF blocks, q4.py) and q8 (int8 blocks, q8.py).

Eager calls go straight through ctypes (~2 us a call, the GIL released while the C code runs);
inside a `torch.compile` graph (`--cpu-compile`) the same function is the opaque custom op
`ketch::block_matmul`, which dynamo neither traces nor breaks on.
"""
from __future__ import annotations

import ctypes

import torch

from ketch.native import build

BLOCK = 32  # weights per block, one scale each (GGUF's Q4 / Q8 block)
TILE = 16  # output rows per tile, as in block_common.h
DTYPES = (torch.bfloat16, torch.float32)  # what the C code reads and writes
_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


VARIANTS = {"q4": ("", "_i8"), "q8": ("",)}  # each library's entry points: ketch_<name>_matmul<variant>


def library(name: str) -> ctypes.CDLL | None:
    lib = build.load(f"{name}_matmul")
    if lib is not None and getattr(lib, f"ketch_{name}_matmul").argtypes is None:  # declared once per library
        for variant in VARIANTS[name]:
            fn = getattr(lib, f"ketch_{name}_matmul{variant}")
            fn.argtypes, fn.restype = _ARGS, ctypes.c_int
        getattr(lib, f"ketch_{name}_isa").restype = ctypes.c_int
    return lib


def matmul(name: str, x: torch.Tensor, records: torch.Tensor, n: int, variant: str = "") -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype, W packed in `records` for product `name`; `variant`
    one of VARIANTS[name] (q4's "_i8": activations rounded to int8, q4_matmul.c)."""
    if torch.compiler.is_compiling():
        return torch.ops.ketch.block_matmul(name, x, records, n, variant)
    return _run(name, x, records, n, variant)


def _run(name: str, x: torch.Tensor, records: torch.Tensor, n: int, variant: str = "") -> torch.Tensor:
    if x.dtype not in DTYPES:
        raise ValueError(f"{name}_matmul: x dtype {x.dtype} is not one of {DTYPES}")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((x.shape[0], n), dtype=x.dtype)
    lib = library(name)  # cached by build.load; tests switch the instruction set by clearing that cache
    if lib is None:  # a packed weight exists only where the library was loaded
        raise RuntimeError(f"{name}_matmul: the native library is not available")
    rc = getattr(lib, f"ketch_{name}_matmul{variant}")(records.data_ptr(), x.data_ptr(), y.data_ptr(),
                                               x.dtype == torch.bfloat16, x.shape[0], n, x.shape[1],
                                               torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"{name}_matmul: could not allocate its scratch")
    return y


@torch.library.custom_op("ketch::block_matmul", mutates_args=())
def block_matmul_op(name: str, x: torch.Tensor, records: torch.Tensor, n: int, variant: str) -> torch.Tensor:
    return _run(name, x, records, n, variant)


@block_matmul_op.register_fake
def _(name: str, x: torch.Tensor, records: torch.Tensor, n: int, variant: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], n)


def per_lane(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """[n, blocks] per-row-block values -> [tiles, blocks, 32 bytes]: 16 fp16 lanes per tile."""
    n, nb = t.shape
    t = torch.nn.functional.pad(t, (0, 0, 0, tiles * TILE - n)).half()
    return t.view(tiles, TILE, nb).transpose(1, 2).contiguous().view(torch.uint8)


def fp16_exact(t: torch.Tensor) -> bool:
    """Whether fp16 holds `t` (GGUF's scales and mins are fp16; a zero m + 8d - 8d may be off by
    an fp32 rounding, which fp16 rounds away)."""
    back = t.half().float()
    return bool(torch.isfinite(back).all()) and bool(((back - t).abs() <= 1e-6 * t.abs()).all())
