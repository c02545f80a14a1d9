"""The attention backend contract shared by the torch (CPU, reference) and Triton (GPU) backends.

The runner describes a step as a list of `SeqChunk`s laid out back to back in the token
dimension; the backend turns that into whatever metadata it needs once per step
(`init_metadata`), then `forward` is called once per layer with that metadata.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SeqChunk:
    """One request's share of a step: tokens [start, start + num_new) of its sequence."""

    start: int  # tokens already in the KV pool (position of the first new token)
    num_new: int
    page_table: list[int]  # covers at least start + num_new tokens

    @property
    def kv_len(self) -> int:
        return self.start + self.num_new


class AttentionBackend(ABC):
    @abstractmethod
    def init_metadata(self, seqs: list[SeqChunk]) -> Any:
        """Build per-step metadata. Decode-like chunks (num_new == 1) come first in `seqs`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: Any) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] of the new tokens (stored by the
        backend into the pool). Returns [tokens, heads, dim]."""
