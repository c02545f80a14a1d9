"""The Llama family's declaration (ketch/models/family.py): Llama 2/3, SmolLM2, Mistral, Qwen2,
Qwen3 share one config (`ModelConfig`), one KV layout (K and V per layer) and one checkpoint
naming; the model is llama.py."""
from __future__ import annotations

from collections.abc import Callable

from ketch.config import KVSpec, ModelConfig
from ketch.models.family import ModelFamily
from ketch.models.llama import LlamaForCausalLM
from ketch.parallel import ParallelContext


def kv_spec(cfg: ModelConfig, parallel: ParallelContext) -> KVSpec:
    """K and V of [this rank's kv heads, head_dim] per layer (ParallelContext.head_share: kv / tp,
    or whole GQA groups as evenly as they go)."""
    return KVSpec.mha(cfg.num_layers, parallel.head_share(cfg.num_heads, cfg.num_kv_heads).num_kv, cfg.head_dim)


def attention_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Layer prefix `p`'s input norm, attention and post-attention norm (everything but its MLP)."""
    shapes: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (c.hidden_size,)}
    shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
    shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
    shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
    if c.attention_bias:  # Qwen2: q/k/v only, o_proj has none
        shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
        shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
        shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
    if c.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
        shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
    shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
    shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
    return shapes


MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def mlp_shapes(p: str, hidden: int, intermediate: int,
               names: tuple[str, str, str] = MLP_NAMES) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate, up and down weights under prefix `p` (`names`: the checkpoint's)."""
    gate, up, down = names
    return {p + f"{gate}.weight": (intermediate, hidden), p + f"{up}.weight": (intermediate, hidden),
            p + f"{down}.weight": (hidden, intermediate)}


def weight_shapes(c: ModelConfig,
                  mlp: Callable[[int, str], dict[str, tuple[int, ...]]] | None = None) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape (Linear weights are [out_features, in_features]), in loading order.
    `mlp(layer, prefix)`: a layer's MLP tensors (a MoE family's); None: the dense MLP."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= attention_shapes(c, p)
        shapes |= mlp(i, p) if mlp else mlp_shapes(p + "mlp.", c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


LLAMA: ModelFamily[ModelConfig] = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    config_from_hf=ModelConfig.from_hf_dict,
    kv_spec=kv_spec,
    weight_shapes=weight_shapes,
    model_class=LlamaForCausalLM,
    cpu_compile=True,
)
