"""Paged KV pool (L1): per layer, the tensors the model's `KVSpec` declares, each of shape
[pages, page_size, *per-token shape]. MHA/GQA: "k" and "v" of [kv_heads, head_dim]
(`pool.k[layer]`, `pool.v[layer]`); an MLA model: one latent tensor per layer.

A token at position p of a request lives in slot page_table[p // page_size] * page_size
+ p % page_size, in every tensor of every layer. Pages are the unit that the allocator, the
radix cache and (later) the host and storage tiers move around, so the layout stays explicit
here rather than inside a kernel; the pool knows tensors by name, never by head counts.

The pages may be narrower than the model (EngineConfig.kv_cache_dtype "fp8_e4m3": tensors of
the spec's "kv" dtype rule are torch.float8_e4m3fn, the model's K/V bf16 or fp32). The scale is
1.0 per tensor, what vLLM and SGLang use when a checkpoint carries no KV scales: a store clamps
to e4m3's finite range [-448, 448] and casts (round to nearest even; e4m3fn has no inf and
converters disagree on what an overflow becomes, so the clamp makes it saturate everywhere); a
read casts up, exactly (every e4m3 value is a bf16/fp16/fp32 value). `gather` returns the
model's dtype; the Triton kernels store and load the same way per tile
(ketch/kernels/kv_store.py, decode_attention.py, extend_attention.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ketch.config import KVSpec
from ketch.kv_dtype import to_kv_dtype  # shared with the Triton store kernel (ketch/kernels/kv_store.py)

if TYPE_CHECKING:
    from ketch.cache.layer_loader import PendingLoad


class KVPool:
    def __init__(
        self,
        spec: KVSpec,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the element type of the spec's "kv" tensors (the model's, or fp8); compute_dtype:
        the model's (K/V come in and `gather` returns it), None: the same as dtype."""
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory: too small for even one page of {page_size} tokens")
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        dtypes = {t.name: t.torch_dtype(dtype, self.compute_dtype) for t in spec.tensors}
        # what a read hands back: the model's dtype for values the model produced, fixed dtypes as stored
        self._read_dtype = {t.name: dtypes[t.name] if isinstance(t.dtype, torch.dtype) else self.compute_dtype
                            for t in spec.tensors}
        self.layers: list[dict[str, torch.Tensor]] = [
            {t.name: torch.zeros((num_pages, page_size, *t.shape), dtype=dtypes[t.name], device=device)
             for t in spec.tensors}
            for _ in range(spec.num_layers)
        ]
        # CUDA: the host→device load (HostPool on its copy stream) the next forward must wait
        # for, layer by layer; None on every other step, and always on the CPU
        self.pending_load: PendingLoad | None = None
        # the attention backends and kernels index these lists directly (MHA specs)
        for name in ("k", "v"):
            if name in dtypes:
                setattr(self, name, [tensors[name] for tensors in self.layers])

    def take_pending_load(self) -> PendingLoad | None:
        """The load the step about to run must wait for (None: nothing is being loaded), once."""
        pending, self.pending_load = self.pending_load, None
        return pending

    def __getattr__(self, name: str) -> object:
        # only reached when normal lookup fails: `k` / `v` of a spec without them
        if name in ("k", "v"):
            raise AttributeError(f"KVPool: the KV spec declares no {name!r} tensor (it has {self.spec.names})")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def bytes_per_token(self) -> int:
        """Every declared tensor of one token over every layer, in the pool's element types."""
        return self.spec.bytes_per_token(self.dtype, self.compute_dtype)

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.bytes_per_token

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """The whole [pages, page_size, *shape] tensor `name` of `layer`."""
        return self.layers[layer][name]

    def write(self, layer: int, name: str, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Write new tokens' rows of tensor `name` ([tokens, *shape]) into their slots."""
        dst = self.layers[layer][name]
        x = to_kv_dtype(x, dst.dtype)
        _bytes(dst).view(-1, *dst.shape[2:]).index_copy_(0, slots, _bytes(x))

    def read_pages(self, layer: int, name: str, page_tables: torch.Tensor) -> torch.Tensor:
        """Tensor `name` of whole pages, [batch, pages * page_size, *shape] for [batch, pages] ids;
        values the model produced come back in compute_dtype (a no-op `.to` when the pool is in it)."""
        src = self.layers[layer][name]
        b, p = page_tables.shape
        # index_select on the page dim copies whole pages; ~3x cheaper than advanced indexing
        pages = src.index_select(0, page_tables.reshape(-1)).view(b, p * self.page_size, *src.shape[2:])
        return pages.to(self._read_dtype[name])

    def read_span(self, layer: int, name: str, first: int, count: int) -> torch.Tensor:
        """read_pages of the consecutive pages first..first+count-1 of one sequence, [1, count *
        page_size, *shape]: a view of the pool (a copy only when the pool is narrower)."""
        src = self.layers[layer][name]
        return src.narrow(0, first, count).view(1, count * self.page_size, *src.shape[2:]).to(self._read_dtype[name])

    def span(self, layer: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA: gather's K/V for one sequence on consecutive pages (read_span)."""
        return self.read_span(layer, "k", first, count), self.read_span(layer, "v", first, count)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """MHA: write new tokens' K/V ([tokens, kv_heads, head_dim]) into their slots."""
        self.write(layer, "k", slots, k)
        self.write(layer, "v", slots, v)

    def gather(self, layer: int, page_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MHA: K/V of whole pages, [batch, pages * page_size, kv_heads, head_dim], in compute_dtype."""
        return self.read_pages(layer, "k", page_tables), self.read_pages(layer, "v", page_tables)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8 (the same bytes): torch has no fp8 index_copy_ on the CPU. Wider dtypes as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t
