"""The DeepSeek-V2/V3 family's declaration (ketch/models/family.py): its config, its KV layout
(one MLA latent per layer and token), its checkpoint names and its attention backend; the model
is deepseek.py.

A layer that the config makes a mixture of experts (index >= first_k_dense_replace, every
moe_layer_freq-th, with n_routed_experts set) has routed and shared experts in place of the dense
MLP: deepseek_moe.py (routing fields, checkpoint names, the block). `moe_layer_freq` is the
original DeepSeek code's rule; transformers 5 ignores it (every released config says 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ketch.attention.base import AttentionBackend
from ketch.attention.mla_backend import MLAAttentionBackend
from ketch.config import KVSpec, KVTensorSpec
from ketch.hf_config import check_hf_fields
from ketch.layers.yarn import YarnScaling
from ketch.models.deepseek import DeepseekForCausalLM
from ketch.models.deepseek_moe import FP32_WEIGHTS, moe_fields, moe_shapes
from ketch.models.family import ModelFamily
from ketch.parallel import ParallelContext

LATENT = "latent"  # the one KV tensor per layer: c_kv | k_pe
ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class DeepseekConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None (V2-Lite): a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    yarn: YarnScaling | None = None
    rope_interleave: bool = True  # rope dims in (x0, x1), (x2, x3)... pairs; V2 always, V3 by default
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj
    tie_word_embeddings: bool = False
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_routed_experts: int | None = None
    moe_intermediate_size: int = 0  # each routed expert's; the shared MLP is n_shared_experts times it
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    topk_method: str = "greedy"  # V2: greedy | group_limited_greedy; V3: noaux_tc (always)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False  # V3 only (HF's V2 router never renormalises)
    routed_scaling_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (layers/yarn.py)."""
        return self.qk_head_dim**-0.5 * (self.yarn.softmax_factor if self.yarn else 1.0)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model); the name the engine's --ep-size check reads."""
        return self.n_routed_experts or 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.n_routed_experts) and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DeepseekConfig":
        check_hf_fields(d)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if name in d and not (isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] > 0):
                raise ValueError(f"{name}: must be a positive integer in config.json, got {d[name]!r}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias: the DeepSeek family has no MLP biases")
        heads = d["num_attention_heads"]
        if (d.get("num_key_value_heads") or heads) != heads:
            raise ValueError("num_key_value_heads: MLA expands the latent into every query head; "
                             f"expected {heads}, got {d['num_key_value_heads']}")
        eos = d.get("eos_token_id")
        return cls(
            architecture=d["architectures"][0], vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"], num_heads=heads,
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"], max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), **_rope(d),
            rope_interleave=bool(d.get("rope_interleave", True)) or d.get("model_type") == "deepseek_v2",
            attention_bias=bool(d.get("attention_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            first_k_dense_replace=d.get("first_k_dense_replace") or 0, moe_layer_freq=d.get("moe_layer_freq") or 1,
            n_routed_experts=d.get("n_routed_experts"), **moe_fields(d), bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        )


def _rope(d: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and YaRN from transformers 5's `rope_parameters` or the released `rope_scaling`."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return {"rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"rope_scaling: the DeepSeek family takes 'yarn' or none, got {kind!r}")
    if rope.get("factor") is None:
        raise ValueError("rope_scaling: yarn needs a factor")
    original = rope.get("original_max_position_embeddings") or d.get("max_position_embeddings", 4096)
    yarn = YarnScaling(float(rope["factor"]), int(original), float(rope.get("beta_fast") or 32),
                       float(rope.get("beta_slow") or 1), rope.get("mscale"), rope.get("mscale_all_dim"),
                       rope.get("attention_factor"), bool(rope.get("truncate", True)))
    return {"rope_theta": theta, "yarn": yarn}


def kv_spec(cfg: DeepseekConfig, parallel: ParallelContext) -> KVSpec:
    """One latent of [kv_lora_rank + qk_rope_head_dim] per layer and token, whole on every rank
    under tensor parallelism (it serves all heads). The heads' split (none under DP attention) is
    checked here all the same: the engine asks for the KV spec before it starts the ranks, so a
    bad split fails there."""
    parallel.for_attention().split(cfg.num_heads, "num_attention_heads")
    return KVSpec(cfg.num_layers, (KVTensorSpec(LATENT, (cfg.latent_dim,)),))


def weight_shapes(c: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape, in loading order (an MoE layer's experts in place of the dense MLP)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    q_out = c.num_heads * c.qk_head_dim
    for i in range(c.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        if c.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (q_out, c.hidden_size)
        else:
            shapes[a + "q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
            if c.attention_bias:
                shapes[a + "q_a_proj.bias"] = (c.q_lora_rank,)
            shapes[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (q_out, c.q_lora_rank)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (c.latent_dim, c.hidden_size)
        if c.attention_bias:
            shapes[a + "kv_a_proj_with_mqa.bias"] = (c.latent_dim,)
        shapes[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
        shapes[a + "o_proj.weight"] = (c.hidden_size, c.num_heads * c.v_head_dim)
        if c.attention_bias:
            shapes[a + "o_proj.bias"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        if c.is_moe_layer(i):
            shapes |= moe_shapes(c, p + "mlp.")
        else:
            shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
            shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def mla_attention(config: DeepseekConfig, pool: Any, *, backend: str, parallel: ParallelContext,
                  device: torch.device, max_model_len: int) -> AttentionBackend:
    """The family's AttentionFactory: "triton" (the engine's pick on CUDA) the MLA Triton kernels
    (ketch/attention/mla_triton_backend.py, imported only then), "torch" the reference."""
    if backend == "triton":
        from ketch.attention.mla_triton_backend import MLATritonBackend

        heads = parallel.split(config.num_heads, "num_attention_heads")  # this rank's
        return MLATritonBackend(pool, LATENT, heads, config.kv_lora_rank, config.softmax_scale, device,
                                decode_splits_len=max_model_len)
    if backend != "torch":
        raise ValueError(f"attention_backend: unknown {backend!r} (expected torch or triton)")
    return MLAAttentionBackend(pool, LATENT, config.softmax_scale, device)


DEEPSEEK: ModelFamily[DeepseekConfig] = ModelFamily(
    name="deepseek",
    architectures=ARCHITECTURES,
    config_from_hf=DeepseekConfig.from_hf,
    kv_spec=kv_spec,
    weight_shapes=weight_shapes,
    model_class=DeepseekForCausalLM,
    attention_backend=mla_attention,
    fp32_weights=FP32_WEIGHTS,
)
