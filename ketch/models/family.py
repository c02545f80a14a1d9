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
    attention_backend(config, pool, backend=, parallel=, device=, max_model_len=)   optional
                                  the backend the model's layers call (`AttentionFactory`);
                                  None: the registry's paged MHA/GQA backend ("torch" or
                                  "triton", `mha_attention_backend`), which reads the config's
                                  num_heads, num_kv_heads and head_dim

The registry (registry.py) maps HF architecture names to families. The pool, the memory plan
and the loaders read only the spec and the shapes; the engine reads only `FamilyConfig`.

A family with another KV layout (one latent per layer, say) adds its config, its spec, its
model and its `attention_backend`, which reads and writes the spec's tensors by name
(`KVPool.write`, `KVPool.read_pages`); cache/, scheduler/, engine/ and runner/ stay as they
are. The runner calls `family.make_attention(...)` once at init and then only the backend's
`init_metadata` (and its graph hooks on CUDA); what the model's layers pass to the backend's
`forward` is between the family's model and its backend. tests/toy_family.py is such a family
(one latent tensor per layer), registered from outside ketch (registry.register_family).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from ketch.attention.base import AttentionBackend
from ketch.attention.registry import create_attention_backend
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


class AttentionFactory(Protocol):
    """Builds a family's attention backend once, at init (the runner's pool, and memory_plan's
    one-page scratch pool on CUDA). `pool` is the KVPool holding the family's `kv_spec` (typed
    Any: models/ does not import cache/); `backend` is EngineConfig's resolved choice ("torch"
    or "triton"), which a family with a single implementation may ignore."""

    def __call__(self, config: Any, pool: Any, *, backend: str, parallel: ParallelContext,
                 device: torch.device, max_model_len: int) -> AttentionBackend: ...


def mha_attention_backend(config: Any, pool: Any, *, backend: str, parallel: ParallelContext,
                          device: torch.device, max_model_len: int) -> AttentionBackend:
    """The paged MHA/GQA backend over a "k"/"v" pool, for this rank's q heads: what a family
    without its own `attention_backend` gets."""
    heads = parallel.head_share(config.num_heads, config.num_kv_heads).num_q
    return create_attention_backend(backend, pool, heads, config.head_dim, device, max_model_len=max_model_len)


@dataclass(frozen=True)
class ModelFamily(Generic[C]):
    name: str
    architectures: tuple[str, ...]  # HF `architectures` names this family serves
    config_from_hf: Callable[[dict[str, Any]], C]
    kv_spec: Callable[[C, ParallelContext], KVSpec]
    weight_shapes: Callable[[C], dict[str, tuple[int, ...]]]
    model_class: Callable[..., nn.Module]  # (config, max_positions, *, ops, parallel) -> CausalLM
    attention_backend: AttentionFactory | None = None  # None: mha_attention_backend
    # name suffixes (checkpoint names, and parameter names without "model.") of tensors kept fp32
    # in a model of any dtype: read, drawn and held in fp32 (DeepSeek's router)
    fp32_weights: tuple[str, ...] = ()
    # whether `cpu_compile` can trace its decode step (runner/cpu_compile.py: dense layers and
    # MHA attention through one custom op; a MoE layer's expert routing syncs with the host and
    # MLA attention has another call shape)
    cpu_compile: bool = False

    def make_attention(self, config: C, pool: Any, *, backend: str, parallel: ParallelContext,
                       device: torch.device, max_model_len: int) -> AttentionBackend:
        """The backend this family's model calls, over `pool`; built once, never per step."""
        factory = self.attention_backend or mha_attention_backend
        return factory(config, pool, backend=backend, parallel=parallel, device=device, max_model_len=max_model_len)
