"""Architecture name → model class. One class covers the whole Llama family for now."""
from __future__ import annotations

from torch import nn

from ketch.config import ModelConfig
from ketch.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    try:
        return _REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"model: unsupported architecture {cfg.architecture!r}; supported: {sorted(_REGISTRY)}") from None
