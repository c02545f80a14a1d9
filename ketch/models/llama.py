"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Tokens of all requests in a step are flattened into one [tokens, hidden] stream; only
attention needs to know where one request ends, and it learns that from the backend metadata.
Projections are fused (q|k|v and gate|up) so a layer runs two big matmuls instead of five.
The residual stream travels beside the hidden states, so each residual add is fused into the
next RMSNorm; norms, RoPE and SiLU·mul go through the `LayerOps` chosen at build time (torch
ops, or the fused Triton kernels on CUDA; ketch/layers/ops.py).

Tensor parallelism (the `ParallelContext` the model is built with; TP=1 by default): q|k|v and
gate|up are column-parallel, o_proj and down_proj row-parallel (one all-reduce each per layer),
the embedding and the LM head vocab-parallel. A rank attends over its own q and kv heads and
keeps only their KV (llama_family.py's kv_spec). The declaration of the family (config, KV
spec, checkpoint names) is in llama_family.py.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ketch.attention.base import AttentionBackend
from ketch.config import ModelConfig
from ketch.layers.norm import RMSNorm
from ketch.layers.ops import TORCH_OPS, FirstProduct, LayerOps
from ketch.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ketch.layers.q4 import Q4Weight
from ketch.layers.rotary import RotaryEmbedding
from ketch.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ketch.models.param_loader import load_int4_parts, load_parameters
from ketch.parallel import SINGLE, ParallelContext

# checkpoint projection -> (our fused parameter, its slot there)
PACKED = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: LayerOps, parallel: ParallelContext) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, parallel=parallel, dense=ops.linear)
        # this rank's heads: attention runs on them alone, between qkv_proj and o_proj
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        share = self.qkv_proj.share  # o_proj reads the same q heads' features
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, bias=False, parallel=parallel, dense=ops.linear,
                                        part=(share.q_start * self.head_dim, self.q_size))
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # q / k head norms (Qwen3) and RoPE: one launch where the op set fuses them
        fused = cfg.qk_norm and ops.qk_norm_rotary is not None
        self._position = self._norm_and_rotate if fused else self._rotate

    def first_product(self) -> FirstProduct | None:
        return self.qkv_proj.first_product()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, meta: Any, first: torch.Tensor | None = None) -> torch.Tensor:
        """first: qkv_proj(x), computed with the norm before (normed_input)."""
        qkv = self.qkv_proj(x) if first is None else first
        heads = self.num_heads + self.num_kv_heads
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        # the Triton layer ops also write k and v into the pool where the backend says where (one
        # launch less a layer); the torch ops leave that to the backend
        sink = attn.kv_sink(self.layer, meta) if self.ops.position_and_store is not None else None
        if sink is None:
            qk = self._position(qk, rope)
        else:
            norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            qk = self.ops.position_and_store(qk, *rope, self.num_heads, v, sink, norm)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = attn.forward(q, k, v, self.layer, meta, stored=sink is not None)
        return self.o_proj(o.reshape(-1, self.q_size))

    def _rotate(self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.q_norm is not None:
            qk = self.ops.qk_norm(qk, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads)
        return self.ops.rotary(qk, *rope)  # q and k heads rotated in one go (in place with Triton)

    def _norm_and_rotate(self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        assert self.ops.qk_norm_rotary is not None and self.q_norm is not None and self.k_norm is not None
        return self.ops.qk_norm_rotary(qk, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads,
                                       *rope)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, parallel: ParallelContext,
                 intermediate_size: int | None = None) -> None:
        """intermediate_size: None is the config's (a MoE model's dense or shared-expert MLP may
        have another)."""
        super().__init__()
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.silu_and_mul = ops.silu_and_mul  # pairs [gate_r | up_r], this rank's features
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, bias=False,
                                                       parallel=parallel, dense=ops.linear, field="intermediate_size")
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False, parallel=parallel,
                                           dense=ops.linear, field="intermediate_size")

    def first_product(self) -> FirstProduct | None:
        return self.gate_up_proj.first_product()

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """first: gate_up_proj(x), computed with the norm before (normed_input)."""
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x) if first is None else first))


def normed_input(ops: LayerOps, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                 sublayer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A sublayer's input h = norm(x + residual) (norm(x) before the first layer, whose residual is
    x), the new residual, and where the op set fuses them (LayerOps.add_rms_norm_linear: one
    launch at one decode row, kernels/norm_gemv.py) the sublayer's first product of h, else None
    (the sublayer computes it). Sublayers that have one declare it: `first_product()`."""
    first = getattr(sublayer, "first_product", lambda: None)() if ops.add_rms_norm_linear is not None else None
    if first is not None:
        return ops.add_rms_norm_linear(x, residual, norm.weight, norm.eps, first)
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x, None
    h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    return h, residual, None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: LayerOps, parallel: ParallelContext,
                 mlp: nn.Module | None = None) -> None:
        """mlp: what follows attention (x [T, H] -> [T, H], whole on every rank); None: LlamaMLP."""
        super().__init__()
        self.ops = ops
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, ops, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, ops, parallel) if mlp is None else mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, still to be added to `residual` (None before the
        first layer: x is the embedding). Returns this layer's MLP output and the residual stream
        before it; each add is fused into the norm that follows it."""
        h, residual, first = normed_input(self.ops, x, residual, self.input_layernorm, self.self_attn)
        h = self.self_attn(h, rope, attn, meta, first=first)
        h, residual, first = normed_input(self.ops, h, residual, self.post_attention_layernorm, self.mlp)
        return self.mlp(h, first=first), residual


class DecoderStack(nn.Module):
    """What every decoder-only family here shares: embed, the layers (each `(x, residual, rope,
    attn, meta) -> (x, residual)`, the residual added into the next norm), the final norm, and
    the logits from the LM head or the tied embedding. A model sets embed_tokens, rotary
    (`lookup(positions, dtype)`), layers, norm, lm_head (None: tied) and ops."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, meta: Any) -> torch.Tensor:
        """Hidden states after the final norm, [tokens, hidden]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn, meta)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    @property
    def logits_head(self) -> VocabParallelEmbedding:
        """The module whose `project` gives the logits: the LM head, or the tied embedding."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_head.project(hidden)


class LlamaForCausalLM(DecoderStack):
    packed = PACKED  # checkpoint projection -> fused parameter (subclasses: their own names)
    name_maps: tuple = ()  # param_loader.NameMap, tried before `packed` (MoE experts)

    def __init__(self, cfg: ModelConfig, max_positions: int, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.parallel = parallel
        # the logits' product: the ops' own when they have one (the skinny GEMM), else torch's
        # (whose one-row kernels the CPU runner picks: VocabParallelEmbedding.pick_one_row_kernel)
        logits_dense = None if ops.linear is F.linear else ops.linear
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel=parallel,
                                                   dense=logits_dense)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ops, parallel, self.make_mlp(cfg, i, ops, parallel))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = None if cfg.tie_word_embeddings else \
            ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel=parallel, dense=logits_dense)
        self.requires_grad_(False)

    def make_mlp(self, cfg: ModelConfig, layer: int, ops: LayerOps, parallel: ParallelContext) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense LlamaMLP (a MoE family returns its sparse block)."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named full tensors; each layer takes its rank's slice (q/k/v and gate/up into their
        fused slots); fails loudly on missing or unknown names. Tied checkpoints sometimes still
        carry an lm_head copy: skipped."""
        load_parameters(self, weights, self.packed, optional=frozenset({"lm_head.weight"}), name_maps=self.name_maps)

    def load_int4(self, weights: Iterable[tuple[str, Q4Weight]]) -> int:
        """Attach 4-bit copies to the linear layers whose every part came as 4-bit blocks.
        Returns how many layers got one."""
        return load_int4_parts(self, weights, self.packed)
