"""The attention backend contract shared by the torch (CPU, reference) and Triton (GPU) backends.

The runner hands over the step's `ForwardBatch` (ketch/forward_batch.py: sequences laid out back
to back in the token dimension, their slots and page tables already computed); the backend turns
that into whatever metadata it needs once per step (`init_metadata`), then `forward` is called
once per layer with that metadata.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from ketch.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_metadata(self, batch: ForwardBatch) -> Any:
        """Build per-step metadata. Decode-like sequences (num_new == 1) come first in the batch."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: Any) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] of the new tokens (stored by the
        backend into the pool). Returns [tokens, heads, dim]."""
