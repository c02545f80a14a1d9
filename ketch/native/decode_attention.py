"""The Python face of decode_attention.c: batch decode attention over the paged pool, bf16, read
in place, optionally after writing the step's own K/V rows into their slots (one call a layer).
`available()` says whether to use it (else the backend keeps SDPA over gathered pages).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ketch.native import build

_i64, _p, _f, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_TAIL = [_p, _p, _p, _i64, _p, _p, _i64, _i64, _i64, _i64, _i64, _f, _int]  # pools, pages, ..., scale, threads
_ARGS = [_p, _i64] + _TAIL
_STORE_ARGS = [_p, _i64, _p, _i64, _p, _i64, _p] + _TAIL


def library() -> ctypes.CDLL | None:
    lib = build.load("decode_attention")
    if lib is not None and lib.ketch_decode_attention_bf16.argtypes is None:  # declared once per library
        lib.ketch_decode_attention_bf16.argtypes = _ARGS
        lib.ketch_decode_attention_bf16.restype = _int
        lib.ketch_store_decode_attention_bf16.argtypes = _STORE_ARGS
        lib.ketch_store_decode_attention_bf16.restype = _int
        lib.ketch_attention_isa.restype = _int
    return lib


def available() -> bool:
    """Built with vector loops (AVX-512 or AVX2): the generic build's scalar loops are slower than
    SDPA over gathered pages (measured on an emulated AVX2 step at batch 32 over ~250 tokens,
    before the AVX2 build had vector loops)."""
    lib = library()
    return lib is not None and lib.ketch_attention_isa() >= build.ISA_CODE["avx2"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, heads, dim] whose heads of a row are contiguous (a view of the fused qkv rows
    qualifies: only the row stride differs); else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, dim] bf16; k_pool / v_pool [pages, page_size, kv_heads, dim] bf16 (one layer's);
    pages [B, >= ceil(len / page_size)] int64 page ids; lens [B] int64, each >= 1 -> [B, heads, dim]."""
    q = _rows(q)
    return _attend(library().ketch_decode_attention_bf16, (q.data_ptr(), q.stride(0)), q, k_pool, v_pool, pages,
                   lens, scale)


def store_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                           k_pool: torch.Tensor, v_pool: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`decode_attention` after writing row b of k / v ([B, kv_heads, dim] bf16) into slot
    slots[b] (int64, [B]) of the pools: what `KVPool.store` and then `decode_attention` do, in one
    call. The caller guarantees the dtypes and that slots are in the pools (the backend's own)."""
    b, _, dim = q.shape
    kv_heads = k_pool.shape[2]
    if k.shape != (b, kv_heads, dim) or v.shape != k.shape or slots.shape != (b,):
        raise ValueError(f"store_decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"slots {tuple(slots.shape)} do not fit pools of {kv_heads} kv heads")
    q, k, v, slots = _rows(q), _rows(k), _rows(v), slots.contiguous()
    head = (q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr())
    return _attend(library().ketch_store_decode_attention_bf16, head, q, k_pool, v_pool, pages, lens, scale)


def _attend(fn: Callable[..., int], head: tuple, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            pages: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Call `fn` with its own leading arguments `head`, then the pools, pages and shapes both
    entry points share."""
    b, heads, dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    if heads % kv_heads:
        raise ValueError(f"decode_attention: {heads} query heads do not group over {kv_heads} kv heads")
    pages, lens = pages.contiguous(), lens.contiguous()
    out = q.new_empty((b, heads, dim))
    rc = fn(*head, k_pool.data_ptr(), v_pool.data_ptr(), pages.data_ptr(), pages.shape[1], lens.data_ptr(),
            out.data_ptr(), b, heads, kv_heads, dim, page_size, scale, torch.get_num_threads())
    if rc != 0:
        raise MemoryError("decode_attention: could not allocate its scratch")
    return out
