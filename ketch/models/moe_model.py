"""Qwen3-MoE and Mixtral: the Llama model (llama.py: attention, q/k norm, rope, norms, embedding,
LM head, tensor parallelism) with sparse MoE blocks (ketch/layers/moe.py) as the MLP of every
sparse layer (`MoEConfig.is_sparse`); Qwen3-MoE's `mlp_only_layers` keep the dense LlamaMLP.

Routing is softmax top-k (ketch/layers/moe_routing.py), renormalised when `norm_topk_prob`
(Mixtral always); with the Triton layer ops it is their one-launch kernel (`ops.softmax_topk`,
ketch/kernels/moe_route.py), picked at build. Checkpoint names: each expert's projections (`experts.<e>.gate_proj` /
Mixtral's `experts.<e>.w1`) go to the layer's fused w13 / w2 slots (`expert_name_map`);
Mixtral's `block_sparse_moe` is our `mlp`.

Expert parallelism (`parallel.ep`, ketch/parallel/expert.py): with ep_size > 1 each sparse
layer is an `ExpertParallelMoE` (ketch/layers/moe_ep.py: whole experts split over the ranks);
under DP attention everything else is built with `parallel.for_attention()` (one rank's whole
heads and vocabulary). `expert_load` counts every sparse layer's routed picks per expert
(ketch/layers/eplb_runtime.py: totals for /metrics, a window for the planner); with EPLB on,
`forward` steps the re-placement after each pass.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ketch.attention.base import AttentionBackend
from ketch.layers.eplb_runtime import Eplb, ExpertLoad
from ketch.layers.moe import MoE
from ketch.layers.moe_ep import ExpertParallelMoE
from ketch.layers.moe_routing import softmax_topk
from ketch.layers.ops import TORCH_OPS, LayerOps
from ketch.models.llama import PACKED, LlamaForCausalLM
from ketch.models.moe_config import MIXTRAL, MoEConfig
from ketch.models.param_loader import expert_name_map
from ketch.parallel import SINGLE, ParallelContext


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: MoEConfig, max_positions: int, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext = SINGLE) -> None:
        self._moe_parallel = parallel  # make_mlp's (the base is built with the attention context)
        super().__init__(cfg, max_positions, ops=ops, parallel=parallel.for_attention())
        ids = [layer.self_attn.layer for layer in self.layers if cfg.is_sparse(layer.self_attn.layer)]
        sparse = [self.layers[i].mlp for i in ids]
        self.expert_load = ExpertLoad([m.gate for m in sparse], cfg.num_experts, ids)
        self.eplb = Eplb(sparse, self.expert_load, parallel) if parallel.ep.eplb_interval else None
        block = cfg.checkpoint_block
        gate, up, down = cfg.expert_names
        self.name_maps = (expert_name_map({gate: "w1", up: "w3", down: "w2"}, block=block),)
        self.packed = PACKED if block == "mlp" else {**PACKED, block: ("mlp", None)}

    def make_mlp(self, cfg: MoEConfig, layer: int, ops: LayerOps, parallel: ParallelContext) -> nn.Module | None:
        if not cfg.is_sparse(layer):
            return None
        select = partial(ops.softmax_topk or softmax_topk, top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob)
        field = "intermediate_size" if cfg.architecture == MIXTRAL else "moe_intermediate_size"  # config.json's name
        moe_parallel = self._moe_parallel
        if moe_parallel.ep.enabled:
            return ExpertParallelMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, select,
                                     parallel=moe_parallel)
        return MoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, select, parallel=parallel, field=field,
                   ops=ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, meta: Any) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, attn, meta)
        if self.eplb is not None:
            self.eplb.step()  # every rank runs every forward: they re-place at the same step
        return hidden
