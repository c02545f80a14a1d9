"""What a model family declares, so that nothing below the registry needs its field names.

    config_from_hf(d)             config.json's dict (GGUF metadata arrives translated into one)
                                  -> the family's frozen config
    kv_spec(config, parallel)     the KV tensors one layer keeps per token on this rank (KVSpec):
                                  MHA/GQA "k" and "v" of [kv_heads / tp, head_dim]; MLA one latent
    weight_shapes(config)         the checkpoint's tensors, HF names -> full (unsharded) shapes, in
                                  loading order: what the safetensors, GGUF and dummy loaders yield
    model_class(config, max_positions, ops=, parallel=)
                                  the nn.Module (the `CausalLM` contract below); its layers load
                                  their own shard of each checkpoint tensor (`load_weights`)

The registry (registry.py) maps HF architecture names to families. The pool, the memory plan
and the loaders read only the spec and the shapes; the engine reads only `FamilyConfig`.

A family with another KV layout (one latent per layer, say) adds its config, its spec and its
model here, plus an attention backend that reads and writes the spec's tensors by name
(`KVPool.write`, `KVPool.read_pages`); cache/, scheduler/ and engine/ stay as they are.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from ketch.config import KVSpec
from ketch.parallel import ParallelContext


class FamilyConfig(Protocol):
    """The fields of a family's config that the engine and the registry read."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


class CausalLM(Protocol):
    """What the runner calls on a model (`nn.Module`s of every family)."""

    parallel: ParallelContext

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any) -> torch.Tensor:
        """Flattened tokens of one step -> hidden states [tokens, hidden]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows that sample -> fp32 logits [rows, vocab] (the whole vocabulary on every rank)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors; each parameter takes its rank's slice; fails on missing/unknown."""

    def load_int4(self, weights: Iterable[tuple[str, Any]]) -> int:
        """4-bit GGUF copies for the layers that can use them; returns how many got one."""


C = TypeVar("C")


@dataclass(frozen=True)
class ModelFamily(Generic[C]):
    name: str
    architectures: tuple[str, ...]  # HF `architectures` names this family serves
    config_from_hf: Callable[[dict[str, Any]], C]
    kv_spec: Callable[[C, ParallelContext], KVSpec]
    weight_shapes: Callable[[C], dict[str, tuple[int, ...]]]
    model_class: Callable[..., nn.Module]  # (config, max_positions, *, ops, parallel) -> CausalLM
