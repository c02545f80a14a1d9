"""Paged KV pool (L1): per layer, K and V tensors of shape [pages, page_size, kv_heads, head_dim].

A token at position p of a request lives in slot page_table[p // page_size] * page_size
+ p % page_size. Pages are the unit that the allocator, the radix cache and (later) the host
and storage tiers move around, so the layout stays explicit here rather than inside a kernel.

The pages may be narrower than the model (EngineConfig.kv_cache_dtype "fp8_e4m3": the pool is
torch.float8_e4m3fn, the model's K/V bf16 or fp32). The scale is 1.0 per tensor, what vLLM and
SGLang use when a checkpoint carries no KV scales: a store clamps to e4m3's finite range
[-448, 448] and casts (round to nearest even; e4m3fn has no inf and converters disagree on what
an overflow becomes, so the clamp makes it saturate everywhere); a read casts up, exactly (every
e4m3 value is a bf16/fp16/fp32 value). `gather` returns the model's dtype; the Triton kernels
store and load the same way per tile (ketch/kernels/kv_store.py, decode_attention.py,
extend_attention.py).
"""
from __future__ import annotations

import torch

from ketch.kv_dtype import to_kv_dtype  # shared with the Triton store kernel (ketch/kernels/kv_store.py)


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the pages' element type; compute_dtype: the model's (K/V come in and `gather`
        returns it), None: the same as dtype."""
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: too small for even one page of {page_size} tokens")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer, in the pool's element type."""
        return 2 * len(self.k) * self.k[0][0, 0].numel() * self.k[0].element_size()

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([tokens, kv_heads, head_dim]) into their slots."""
        kv_heads, head_dim = k.shape[1], k.shape[2]
        k, v = to_kv_dtype(k, self.dtype), to_kv_dtype(v, self.dtype)
        _bytes(self.k[layer]).view(-1, kv_heads, head_dim).index_copy_(0, slots, _bytes(k))
        _bytes(self.v[layer]).view(-1, kv_heads, head_dim).index_copy_(0, slots, _bytes(v))

    def gather(self, layer: int, page_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole pages, [batch, pages * page_size, kv_heads, head_dim] for [batch, pages] ids,
        in compute_dtype (a no-op `.to` when the pool is in the model's dtype)."""
        b, p = page_tables.shape
        flat = page_tables.reshape(-1)
        # index_select on the page dim copies whole pages; ~3x cheaper than advanced indexing
        k = self.k[layer].index_select(0, flat).view(b, p * self.page_size, *self.k[layer].shape[2:])
        v = self.v[layer].index_select(0, flat).view(b, p * self.page_size, *self.v[layer].shape[2:])
        return k.to(self.compute_dtype), v.to(self.compute_dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8 (the same bytes): torch has no fp8 index_copy_ on the CPU. Wider dtypes as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
