"""The Python face of decode_attention.c: batch decode attention over the paged pool, bf16, read
in place. `available()` says whether to use it (else the backend keeps SDPA over gathered pages).
"""
from __future__ import annotations

import ctypes

import torch

from ketch.native import build

_i64, _p = ctypes.c_int64, ctypes.c_void_p
_ARGS = [_p, _p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int]


def library() -> ctypes.CDLL | None:
    lib = build.load("decode_attention")
    if lib is not None and lib.ketch_decode_attention_bf16.argtypes is None:  # declared once per library
        lib.ketch_decode_attention_bf16.argtypes = _ARGS
        lib.ketch_decode_attention_bf16.restype = ctypes.c_int
        lib.ketch_attention_isa.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Built with vector loops (AVX-512 or AVX2): the generic build's scalar loops are slower than
    SDPA over gathered pages (measured on an emulated AVX2 step at batch 32 over ~250 tokens,
    before the AVX2 build had vector loops)."""
    lib = library()
    return lib is not None and lib.ketch_attention_isa() >= build.ISA_CODE["avx2"]


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, dim] bf16; k_pool / v_pool [pages, page_size, kv_heads, dim] bf16 (one layer's);
    pages [B, >= ceil(len / page_size)] int64 page ids; lens [B] int64, each >= 1 -> [B, heads, dim]."""
    b, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads do not group over {kv_heads} kv heads")
    q = q.contiguous()
    pages, lens = pages.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    rc = library().ketch_decode_attention_bf16(
        q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), pages.data_ptr(), pages.shape[1], lens.data_ptr(),
        out.data_ptr(), b, heads, kv_heads, dim, page_size, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("decode_attention: could not allocate its scratch")
    return out
