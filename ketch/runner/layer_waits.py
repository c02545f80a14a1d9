"""The attention of a step that follows a host→device load: each layer waits for its own pages.

A host-tier hit is copied back on a side stream, layer by layer (ketch/cache/layer_loader.py).
For the one step after such a load the runner hands the model this wrapper instead of its
backend: before layer l's attention (the first thing of the layer that reads or writes the KV
pool) the compute stream waits for event l of the load, so layer 0 runs while later layers'
pages are still copying. Every other step gets the backend itself: no check per layer.
"""
from __future__ import annotations

from typing import Any

import torch

from ketch.attention.base import AttentionBackend
from ketch.cache.layer_loader import PendingLoad
from ketch.forward_batch import ForwardBatch


class LayerWaitingAttention(AttentionBackend):
    """`inner`, with a stream wait for the pending load's layer before each layer's forward."""

    def __init__(self, inner: AttentionBackend, pending: PendingLoad) -> None:
        self.inner = inner
        self.pending = pending

    def init_metadata(self, batch: ForwardBatch) -> Any:
        return self.inner.init_metadata(batch)

    def forward(self, q: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
        """MHA: (q, k, v, layer, metadata); MLA (attention/mla_backend.py): (q, latent, layer,
        metadata, w_uk, w_uv[, stored=]). Either way the layer's pages are waited for first."""
        self.pending.wait_layer(rest[1] if len(rest) == 5 else rest[2])  # MLA: 5 after q; MHA: 4
        return self.inner.forward(q, *rest, **kw)

    def kv_sink(self, layer: int, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """MHA: where the layer op stores the new k and v, if the backend lets it; as latent_sink."""
        sink = self.inner.kv_sink(layer, metadata)
        if sink is not None:
            self.pending.wait_layer(layer)
        return sink

    def latent_sink(self, layer: int, metadata: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """MLA: where the layer op stores the new latents, if the backend lets it; that store is
        the layer's first touch of the pool, so the wait comes before it."""
        sink = self.inner.latent_sink(layer, metadata)  # type: ignore[attr-defined]
        if sink is not None:
            self.pending.wait_layer(layer)
        return sink

    def absorbs_query(self, metadata: Any) -> bool:
        """MLA: whether forward takes the decode rows' absorbed query (q_lat=) made by the layer op."""
        return self.inner.absorbs_query(metadata)  # type: ignore[attr-defined]
