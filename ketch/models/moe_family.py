"""The sparse mixture-of-experts family's declaration (ketch/models/family.py): Qwen3-MoE and
Mixtral. Config: moe_config.py; model: moe_model.py; KV: the Llama family's K and V per layer;
checkpoint: the Llama names, with each sparse layer's router and per-expert projections in
place of the dense MLP."""
from __future__ import annotations

from ketch.config import KVSpec
from ketch.models.family import ModelFamily
from ketch.models.llama_family import kv_spec as llama_kv_spec, mlp_shapes, weight_shapes as llama_weight_shapes
from ketch.models.moe_config import MIXTRAL, QWEN3_MOE, MoEConfig
from ketch.models.moe_model import MoEForCausalLM
from ketch.parallel import ParallelContext


def kv_spec(c: MoEConfig, parallel: ParallelContext) -> KVSpec:
    """The Llama family's K and V of this rank's heads (every head under DP attention)."""
    return llama_kv_spec(c, parallel.for_attention())


def weight_shapes(c: MoEConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape, in loading order: a sparse layer's router [experts, hidden] and each
    expert's gate / up [moe_intermediate, hidden] and down [hidden, moe_intermediate]."""

    def mlp(layer: int, p: str) -> dict[str, tuple[int, ...]]:
        if not c.is_sparse(layer):
            return mlp_shapes(p + "mlp.", c.hidden_size, c.intermediate_size)
        block = p + c.checkpoint_block + "."
        shapes = {block + "gate.weight": (c.num_experts, c.hidden_size)}
        for e in range(c.num_experts):
            shapes |= mlp_shapes(f"{block}experts.{e}.", c.hidden_size, c.moe_intermediate_size, c.expert_names)
        return shapes

    return llama_weight_shapes(c, mlp)


MOE: ModelFamily[MoEConfig] = ModelFamily(
    name="moe",
    architectures=(MIXTRAL, QWEN3_MOE),
    config_from_hf=MoEConfig.from_hf_dict,
    kv_spec=kv_spec,
    weight_shapes=weight_shapes,
    model_class=MoEForCausalLM,
)
