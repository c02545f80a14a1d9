"""The config of the sparse mixture-of-experts families (moe_family.py): Qwen3-MoE and Mixtral,
a Llama-family decoder (ketch/config.py `ModelConfig`: attention, norms, rope) whose MLPs are
sparse blocks of `num_experts` SwiGLU experts, `num_experts_per_tok` per token.

config.json's fields, per architecture (transformers 5 names; its Qwen3MoeConfig writes
`num_local_experts` where released Qwen3-MoE configs say `num_experts`: both are read):

    Qwen3MoeForCausalLM   num_experts, num_experts_per_tok, moe_intermediate_size,
                          norm_topk_prob (HF's default False), decoder_sparse_step,
                          mlp_only_layers (dense layers: intermediate_size), q/k norm
    MixtralForCausalLM    num_local_experts, num_experts_per_tok, intermediate_size (each expert's);
                          every layer sparse, the top-k weights always renormalised
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ketch.config import ModelConfig

MIXTRAL = "MixtralForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"


@dataclass(frozen=True)
class MoEConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's
    norm_topk_prob: bool = True  # the k routing weights rescaled to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here

    def is_sparse(self, layer: int) -> bool:
        """Qwen3-MoE's rule (Mixtral: every layer)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def checkpoint_block(self) -> str:
        """The sparse block's name in the checkpoint (`model.layers.<i>.<block>.gate.weight`)."""
        return "block_sparse_moe" if self.architecture == MIXTRAL else "mlp"

    @property
    def expert_names(self) -> tuple[str, str, str]:
        """An expert's gate, up and down projections as the checkpoint names them."""
        return ("w1", "w3", "w2") if self.architecture == MIXTRAL else ("gate_proj", "up_proj", "down_proj")

    def __post_init__(self) -> None:
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} of {self.num_experts} experts")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "MoEConfig":
        base = ModelConfig.from_hf_dict(d)
        if d.get("sliding_window") and (base.architecture == MIXTRAL or d.get("use_sliding_window")):
            raise ValueError(f"sliding_window: {d['sliding_window']} is not supported (full attention only)")
        common = {f.name: getattr(base, f.name) for f in fields(ModelConfig)}
        if base.architecture == MIXTRAL:
            return cls(**common, num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                       moe_intermediate_size=d["intermediate_size"], norm_topk_prob=True)
        common["qk_norm"] = True
        num_experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
        return cls(**common, num_experts=num_experts, num_experts_per_tok=d["num_experts_per_tok"],
                   moe_intermediate_size=d["moe_intermediate_size"],
                   norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                   mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
