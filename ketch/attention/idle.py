"""The attention of an idle forward: no tokens, no pages, no metadata.

Under DP attention (engine/dp_attention.py) every rank runs each forward together, because the
MoE layers gather the ranks' tokens inside it; a rank with nothing scheduled runs the model over
zero tokens so that it joins those collectives. Its attention has nothing to read or store: it
returns the empty output of the shape the layer reshapes.
"""
from __future__ import annotations

from typing import Any

import torch

from ketch.forward_batch import ForwardBatch


class IdleAttention:
    def init_metadata(self, batch: ForwardBatch) -> None:
        return None

    def latent_sink(self, layer: int, meta: Any) -> None:
        return None  # MLA: nothing to store

    def kv_sink(self, layer: int, meta: Any) -> None:
        return None  # MHA: nothing to store

    def absorbs_query(self, meta: Any) -> bool:
        return False  # MLA: no rows

    def forward(self, q: torch.Tensor, *rest: Any, stored: bool = False) -> torch.Tensor:
        """MHA: (q, k, v, layer, metadata) -> [0, heads, v's dim]; MLA (mla_backend.py):
        (q, latent, layer, metadata, w_uk, w_uv) -> [0, heads, w_uv's dim 1]."""
        v_dim = rest[4].shape[1] if len(rest) == 5 else rest[1].shape[-1]
        return q.new_empty(0, q.shape[1], v_dim)

IDLE_ATTENTION = IdleAttention()
