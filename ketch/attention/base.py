"""The attention backend contract shared by the torch (CPU, reference) and Triton (GPU) backends.

The runner hands over the step's `ForwardBatch` (ketch/forward_batch.py: sequences laid out back
to back in the token dimension, their slots and page tables already computed); the backend turns
that into whatever metadata it needs once per step (`init_metadata`), then `forward` is called
once per layer with that metadata.

Decode CUDA graphs: one graph runner (ketch/runner/graph_runner.py) serves every backend. It
owns the batch sizes, capture, replay, the future-token resolve and the logits; the backend
owns its static buffers through the hooks below, because only it knows its metadata layout
and how a step's inputs reach the device in the fewest copies. A key is a tuple whose first
item is the graph's batch size (rows); the rest is the backend's (the torch backend's page
bucket). A new backend (MLA, sliding window) implements the hooks and needs no new runner.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from ketch.forward_batch import ForwardBatch

GraphKey = tuple[int, ...]  # (batch size, backend-specific dimensions...)


@dataclass
class GraphInputs:
    """What one graph's forward reads: views over the backend's static buffers."""

    ids: torch.Tensor  # [bs] int32 or int64, placeholders allowed (resolved inside the graph)
    positions: torch.Tensor  # [bs]
    metadata: Any  # the backend's metadata type, as `forward` expects it


class AttentionBackend(ABC):
    @abstractmethod
    def init_metadata(self, batch: ForwardBatch) -> Any:
        """Build per-step metadata. Decode-like sequences (num_new == 1) come first in the batch."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: Any,
                stored: bool = False) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] of the new tokens, stored by the
        backend into the pool unless `stored` (they were written where kv_sink said). Returns
        [tokens, heads, dim]."""

    def kv_sink(self, layer: int, metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a layer op may write the new k and v itself, in the launch that puts them in
        position (LayerOps.position_and_store): (k_cache, v_cache, slots), after which forward is
        called with stored=True; None: forward stores them (this default)."""
        return None

    # ------------------------------------------------------------ decode-graph hooks
    def init_capture(self, sizes: list[int], max_model_len: int) -> list[GraphKey]:
        """Allocate the static buffers for decode steps of up to max(sizes) rows; return the keys
        to capture at init ([]: capture each key on first use). Called once, by one graph runner."""
        raise NotImplementedError(f"{type(self).__name__} has no decode-graph hooks")

    def graph_key(self, batch: ForwardBatch, bs: int) -> GraphKey | None:
        """The graph of `bs` rows (>= batch.num_seqs, a runner size) that serves this decode
        step, or None when none can (the step then runs eagerly)."""
        raise NotImplementedError

    def prepare_capture(self, key: GraphKey) -> None:
        """Before an init capture (no step at hand): make the static buffers safe to run, e.g.
        padding rows that write nothing. A key captured on first use is captured right after
        `prepare_replay` filled the buffers with that step, which must be safe to rerun."""

    def capture_inputs(self, key: GraphKey) -> GraphInputs:
        """The inputs of graph `key` over the static buffers. Runs inside the captured region:
        device work here is recorded and replayed each step (a mask built from static lengths)."""
        raise NotImplementedError

    def prepare_replay(self, batch: ForwardBatch, key: GraphKey) -> None:
        """Fill the static buffers of graph `key` from this step (ids and positions included)."""
        raise NotImplementedError
