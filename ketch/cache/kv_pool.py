"""Paged KV pool (L1): per layer, K and V tensors of shape [pages, page_size, kv_heads, head_dim].

A token at position p of a request lives in slot page_table[p // page_size] * page_size
+ p % page_size. Pages are the unit that the allocator, the radix cache and (later) the host
and storage tiers move around, so the layout stays explicit here rather than inside a kernel.
"""
from __future__ import annotations

import torch


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
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: too small for even one page of {page_size} tokens")
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([tokens, kv_heads, head_dim]) into their slots."""
        kv_heads, head_dim = k.shape[1], k.shape[2]
        self.k[layer].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    def gather(self, layer: int, page_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole pages, [batch, pages * page_size, kv_heads, head_dim] for [batch, pages] ids."""
        b, p = page_tables.shape
        flat = page_tables.reshape(-1)
        # index_select on the page dim copies whole pages; ~3x cheaper than advanced indexing
        k = self.k[layer].index_select(0, flat).view(b, p * self.page_size, *self.k[layer].shape[2:])
        v = self.v[layer].index_select(0, flat).view(b, p * self.page_size, *self.v[layer].shape[2:])
        return k, v
