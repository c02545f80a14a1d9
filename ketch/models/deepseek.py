"""DeepSeek-V2/V3: multi-head latent attention over a latent KV cache.

A layer's attention, per token (the declaration, deepseek_family.py, has the shapes):

    q        = q_proj(x)                     or  q_b_proj(q_a_layernorm(q_a_proj(x)))   (q LoRA)
             -> [heads, nope | rope], the rope part rotated
    c | k_pe = kv_a_proj_with_mqa(x)         c -> kv_a_layernorm; k_pe (one for all heads) rotated
    (q_proj or q_a_proj, and kv_a_proj_with_mqa, read the same x: they are one stacked product,
    q_kv_a_proj, one weight stream instead of two at decode)
    latent   = c | k_pe                      the only thing the KV pool keeps
    out      = o_proj(MLA(q, latent; kv_b_proj))   ketch/attention/mla_backend.py

RoPE touches only the qk_rope_head_dim part, with YaRN scaling (layers/yarn.py): the tables
carry YaRN's rope factor, the backend's softmax scale its mscale^2. DeepSeek lays the rope dims
out in interleaved pairs (x0, x1), (x2, x3)... (V2 always, V3 unless rope_interleave is false):
they are gathered to [even | odd] and rotated in the rotate-half layout, which is HF V3's own
formula; V2's complex product keeps the pairs in place instead, a permutation of the same
numbers applied to q_pe and k_pe alike, so every score is the same.

The residual adds are fused into the next norm as in the Llama family (llama.py), whose MLP
(gate|up fused, SiLU) the dense layers reuse; the mixture-of-experts layers' block (routed +
shared experts) is deepseek_moe.py. Tensor parallel: the heads, the MLPs' and experts'
intermediate features and the vocabulary are split over the ranks, the latent is whole on each.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ketch.layers.eplb_runtime import Eplb, ExpertLoad
from ketch.layers.norm import RMSNorm
from ketch.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, StackedLinear
from ketch.layers.ops import TORCH_OPS, FirstProduct, LayerOps
from ketch.layers.rotary import apply_rotary
from ketch.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ketch.layers.yarn import ScaledRotary
from ketch.models.deepseek_moe import EXPERT_NAMES, DeepseekEPMoE, DeepseekMoE, shared_expert_names
from ketch.models.llama import DecoderStack, LlamaMLP, normed_input
from ketch.models.param_loader import load_parameters
from ketch.parallel import SINGLE, ParallelContext

if TYPE_CHECKING:
    from ketch.models.deepseek_family import DeepseekConfig

PACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),  # not Llama's q/k/v
          "q_proj": ("q_kv_a_proj", 0), "q_a_proj": ("q_kv_a_proj", 0), "kv_a_proj_with_mqa": ("q_kv_a_proj", 1)}
LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: the norms' default, not rms_norm_eps (as HF)


class DeepseekAttention(nn.Module):
    def __init__(self, c: DeepseekConfig, layer: int, ops: LayerOps, parallel: ParallelContext = SINGLE) -> None:
        """Under tensor parallelism each rank has its share of the heads: q (or q_b) and kv_b
        split by output rows, o by input columns (summed over the ranks); the LoRA down-projections
        and the latent are whole on every rank (one latent for all heads: nothing to split)."""
        super().__init__()
        self.layer, self.ops, self.interleave = layer, ops, c.rope_interleave
        self.heads, self.nope, self.rank = parallel.split(c.num_heads, "num_attention_heads"), c.qk_nope_head_dim, \
            c.kv_lora_rank
        q_out, lin = c.num_heads * c.qk_head_dim, ops.linear
        # the two projections of x in one product (PACKED's shard 0 and 1): q (its heads split
        # over the ranks) or q LoRA's down-projection (whole), and the latent's (whole)
        lora = c.q_lora_rank is not None
        self.q_kv_a_proj = StackedLinear(c.hidden_size, (c.q_lora_rank if lora else q_out, c.latent_dim),
                                         split=(not lora, False), biased=(lora and c.attention_bias, c.attention_bias),
                                         parallel=parallel, dense=lin, field="num_attention_heads")
        if lora:
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(c.q_lora_rank, q_out, parallel=parallel, dense=lin)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                              parallel=parallel)
        self.o_proj = RowParallelLinear(c.num_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias,
                                        parallel=parallel, dense=lin)
        self._prepare = ops.mla_prepare or self._prepare_torch  # the Triton ops' one launch (CUDA)

    def _query(self, q: torch.Tensor) -> torch.Tensor:
        """q_kv_a_proj's first part -> q (through q LoRA's norm and up-projection if any)."""
        if not hasattr(self, "q_b_proj"):
            return q
        n = self.q_a_layernorm
        return self.q_b_proj(self.ops.rms_norm(q, n.weight, n.eps))

    def _prepare_torch(self, q: torch.Tensor, ckv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       weight: torch.Tensor, eps: float, nope: int, interleave: bool,
                       store: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q's rope part rotated, the latent = normed c | rotated k_pe (LayerOps.mla_prepare's contract;
        never asked to store: the backend stores what the torch glue hands it)."""
        rank = ckv.shape[1] - (q.shape[2] - nope)
        q = torch.cat((q[..., :nope], _rotate(q[..., nope:], cos, sin, interleave)), -1)
        c = self.ops.rms_norm(ckv[:, :rank], weight, eps)
        return q, torch.cat((c, _rotate(ckv[:, None, rank:], cos, sin, interleave)[:, 0]), -1)

    def first_product(self) -> FirstProduct | None:
        return self.q_kv_a_proj.first_product()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: Any, meta: Any,
                first: torch.Tensor | None = None) -> torch.Tensor:
        """first: q_kv_a_proj(x), computed with the norm before (normed_input)."""
        t = x.shape[0]
        q, ckv = self.q_kv_a_proj.parts(self.q_kv_a_proj(x) if first is None else first)
        q = self._query(q)
        q = q.view(t, self.heads, q.shape[1] // self.heads)  # (not -1: an idle forward has t == 0)
        n = self.kv_a_layernorm
        # the layer ops' prepare (Triton) also writes the latents into the pool where the
        # backend says where (one launch less); the torch glue leaves that to the backend
        sink = attn.latent_sink(self.layer, meta) if self.ops.mla_prepare is not None else None
        w = self.kv_b_proj.weight.view(self.heads, -1, self.rank)  # [heads, nope + v, rank]
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        if sink is not None and self.ops.mla_prepare_absorb is not None and attn.absorbs_query(meta):
            # a few decode rows: q_nope W_UK in the prepare's launch (kernels/mla_prepare.py)
            q, latent, q_lat = self.ops.mla_prepare_absorb(q, ckv, *rope, n.weight, n.eps, self.nope, self.interleave,
                                                           w_uk, store=sink)
            o = attn.forward(q, latent, self.layer, meta, w_uk, w_uv, stored=True, q_lat=q_lat)
        else:
            q, latent = self._prepare(q, ckv, *rope, n.weight, n.eps, self.nope, self.interleave, store=sink)
            o = attn.forward(q, latent, self.layer, meta, w_uk, w_uv, stored=sink is not None)
        return self.o_proj(o.flatten(1))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, c: DeepseekConfig, layer: int, ops: LayerOps, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.ops, self.eps = ops, c.rms_norm_eps
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        dense = parallel.for_attention()  # the ranks' context of everything but the routed experts
        self.self_attn = DeepseekAttention(c, layer, ops, dense)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # the dense MLP reads hidden/intermediate_size off the config
        if not c.is_moe_layer(layer):
            self.mlp = LlamaMLP(c, ops, dense)  # type: ignore[arg-type]
        else:
            self.mlp = DeepseekEPMoE(c, ops, parallel) if parallel.ep.enabled else DeepseekMoE(c, ops, parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                attn: Any, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer: returns this layer's MLP output and the residual before it."""
        h, residual, first = normed_input(self.ops, x, residual, self.input_layernorm, self.self_attn)
        h = self.self_attn(h, rope, attn, meta, first=first)
        h, residual, first = normed_input(self.ops, h, residual, self.post_attention_layernorm, self.mlp)
        return self.mlp(h, first=first), residual


class DeepseekForCausalLM(DecoderStack):
    """The `CausalLM` contract (ketch/models/family.py)."""

    def __init__(self, cfg: DeepseekConfig, max_positions: int, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        dense = parallel.for_attention()
        self.config, self.ops, self.parallel = cfg, ops, dense
        # the logits' product as Llama's: the ops' skinny GEMM on CUDA (cuBLAS streamed V2-Lite's
        # 419 MB head at one row ~10 % slower, H100 run 77), torch's one-row kernels on the CPU
        logits_dense = None if ops.linear is F.linear else ops.linear
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel=dense,
                                                   dense=logits_dense)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, ops, parallel) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = ScaledRotary(cfg.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.yarn)
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size,
                                                                          parallel=dense, dense=logits_dense)
        ids = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]  # routed picks per expert: /metrics
        sparse = [self.layers[i].mlp for i in ids]
        self.expert_load = ExpertLoad([m.gate for m in sparse], cfg.n_routed_experts or 0, ids)
        # the shared MLPs' checkpoint tensors go into the fused experts' last slots where folded
        folded = any(isinstance(m, DeepseekMoE) and m.experts.shared for m in sparse)
        self.name_maps = (EXPERT_NAMES, shared_expert_names) if folded else (EXPERT_NAMES,)
        self.eplb = Eplb(sparse, self.expert_load, parallel) if parallel.ep.eplb_interval else None
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, meta: Any) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, attn, meta)
        if self.eplb is not None:
            self.eplb.step()  # every rank runs every forward: they re-place at the same step
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors (gate/up into the fused MLP slot, each routed expert's projections into
        its layer's w13 / w2, the shared experts' too where folded). V3 checkpoints also carry
        their multi-token-prediction layer(s) after the last decoder layer: not used, skipped."""
        n = self.config.num_layers
        load_parameters(self, ((k, v) for k, v in weights if _layer_index(k) < n), PACKED,
                        optional=frozenset({"lm_head.weight"}), name_maps=self.name_maps)

    def load_int4(self, weights: Iterable[tuple[str, Any]]) -> int:
        return 0  # no GGUF of this family yet


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [tokens, heads, rope_dim] -> rotated (interleaved pairs gathered to [even | odd] first)."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), -1)
    return apply_rotary(x, cos, sin)


def _layer_index(name: str) -> int:
    """model.layers.<i>. -> i; -1 for names outside the decoder layers."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] else -1
