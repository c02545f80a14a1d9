"""The KV pages' element type, and how K/V of the model's dtype become it.

A leaf below both users: the torch pool (ketch/cache/kv_pool.py) and the Triton store kernel
with its reference (ketch/kernels/kv_store.py) must convert the same way, and a kernel may not
import cache/. fp8 e4m3 pages use scale 1.0: clamp to e4m3's finite range, then cast (round to
nearest even; e4m3fn has no inf, and converters disagree on what an overflow becomes, so the
clamp makes it saturate everywhere).
"""
from __future__ import annotations

import torch

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the pool stores it: unchanged in its own dtype; e4m3 (scale 1.0) clamped first."""
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(dtype)
