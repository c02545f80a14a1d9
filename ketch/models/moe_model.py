"""Qwen3-MoE and Mixtral: the Llama model (llama.py: attention, q/k norm, rope, norms, embedding,
LM head, tensor parallelism) with sparse MoE blocks (ketch/layers/moe.py) as the MLP of every
sparse layer (`MoEConfig.is_sparse`); Qwen3-MoE's `mlp_only_layers` keep the dense LlamaMLP.

Routing is softmax top-k (ketch/layers/moe_routing.py), renormalised when `norm_topk_prob`
(Mixtral always). Checkpoint names: each expert's projections (`experts.<e>.gate_proj` /
Mixtral's `experts.<e>.w1`) go to the layer's fused w13 / w2 slots (`expert_name_map`);
Mixtral's `block_sparse_moe` is our `mlp`.
"""
from __future__ import annotations

from functools import partial

from torch import nn

from ketch.layers.moe import MoE
from ketch.layers.moe_routing import softmax_topk
from ketch.layers.ops import TORCH_OPS, LayerOps
from ketch.models.llama import PACKED, LlamaForCausalLM
from ketch.models.moe_config import MIXTRAL, MoEConfig
from ketch.models.param_loader import expert_name_map
from ketch.parallel import SINGLE, ParallelContext


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: MoEConfig, max_positions: int, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(cfg, max_positions, ops=ops, parallel=parallel)
        block = cfg.checkpoint_block
        gate, up, down = cfg.expert_names
        self.name_maps = (expert_name_map({gate: "w1", up: "w3", down: "w2"}, block=block),)
        self.packed = PACKED if block == "mlp" else {**PACKED, block: ("mlp", None)}

    def make_mlp(self, cfg: MoEConfig, layer: int, ops: LayerOps, parallel: ParallelContext) -> nn.Module | None:
        if not cfg.is_sparse(layer):
            return None
        select = partial(softmax_topk, top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        field = "intermediate_size" if cfg.architecture == MIXTRAL else "moe_intermediate_size"  # config.json's name
        return MoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, select, parallel=parallel, field=field,
                   ops=ops)
