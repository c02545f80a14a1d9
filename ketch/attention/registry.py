"""Pick an attention backend by name at init (the step loop never branches on it)."""
from __future__ import annotations

import torch

from ketch.attention.base import AttentionBackend
from ketch.cache.kv_pool import KVPool

BACKENDS = ("torch", "triton")


def create_attention_backend(name: str, pool: KVPool, num_heads: int, head_dim: int, device: torch.device,
                             *, max_model_len: int | None = None) -> AttentionBackend:
    """"torch": SDPA over gathered pages (any device, the reference); "triton": the Triton
    kernels (GPU, or the CPU interpreter under TRITON_INTERPRET=1). Triton is imported only here.
    max_model_len (triton): decode split counts then depend on the batch size only."""
    if name == "torch":
        from ketch.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, head_dim, device)
    if name == "triton":
        from ketch.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, num_heads, head_dim, device, decode_splits_len=max_model_len)
    raise ValueError(f"attention_backend: unknown {name!r} (expected one of {', '.join(BACKENDS)})")
