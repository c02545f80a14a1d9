"""The loading loop (ketch/models/param_loader.py) and the layers' own loaders: each parameter
of a tiny Llama takes exactly its rank's slice of the full checkpoint tensors (rank 1 of 2,
built with a planning context: loading needs no collectives), 4-bit parts are sliced the same
way, and missing, unexpected or misshapen tensors fail naming the weight."""
from __future__ import annotations

import pytest
import torch

from ketch.config import ModelConfig
from ketch.layers.q4 import Q4Weight
from ketch.models.llama import LlamaForCausalLM
from ketch.models.llama_family import LLAMA
from ketch.parallel import SINGLE, ParallelContext

CFG = ModelConfig.from_hf_dict(dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=99, hidden_size=64, intermediate_size=96,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
RANK1 = ParallelContext(1, 2)  # no group: shapes and loading only


def checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in LLAMA.weight_shapes(CFG).items()}


def load(parallel: ParallelContext, weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG, 16, parallel=parallel)
    model.load_weights(weights.items())
    return model


def second_half(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return t.chunk(2, dim)[1]


def test_each_parameter_holds_its_ranks_slice():
    w, p = checkpoint(), "model.layers.0."
    full, mine = load(SINGLE, w), load(RANK1, w)
    attn, mlp = mine.layers[0].self_attn, mine.layers[0].mlp
    q, k, v = (w[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(full.layers[0].self_attn.qkv_proj.weight, torch.cat([q, k, v]))  # TP=1: the fused layout
    assert torch.equal(attn.qkv_proj.weight, torch.cat([second_half(q), second_half(k), second_half(v)]))
    assert torch.equal(attn.qkv_proj.bias, torch.cat([second_half(w[p + f"self_attn.{x}_proj.bias"]) for x in "qkv"]))
    assert torch.equal(attn.o_proj.weight, second_half(w[p + "self_attn.o_proj.weight"], 1))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([second_half(w[p + "mlp.gate_proj.weight"]),
                                                           second_half(w[p + "mlp.up_proj.weight"])]))
    assert torch.equal(mlp.down_proj.weight, second_half(w[p + "mlp.down_proj.weight"], 1))
    assert torch.equal(mine.layers[0].input_layernorm.weight, w[p + "input_layernorm.weight"])  # replicated
    # 99 vocab rows: rank 1 holds rows 50..98 and one zero row of padding
    for name, layer in (("model.embed_tokens.weight", mine.embed_tokens), ("lm_head.weight", mine.lm_head)):
        assert torch.equal(layer.weight[:49], w[name][50:]) and not layer.weight[49].any()


def test_missing_unexpected_and_misshapen_weights_name_the_weight():
    w = checkpoint()
    with pytest.raises(ValueError, match=r"model: missing weights .*qkv_proj.*'k'"):
        load(RANK1, {n: t for n, t in w.items() if "k_proj.weight" not in n})
    with pytest.raises(ValueError, match="model: unexpected weight 'model.layers.0.mlp.extra.weight'"):
        load(SINGLE, w | {"model.layers.0.mlp.extra.weight": torch.zeros(1)})
    bad = w | {"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 60)}
    with pytest.raises(ValueError, match=r"model: weight '.*up_proj.weight' has shape \(96, 60\), expected \(96, 64\)"):
        load(RANK1, bad)
    with pytest.raises(ValueError, match=r"embed_tokens.weight' has shape \(98, 64\), expected \(99, 64\)"):
        load(RANK1, w | {"model.embed_tokens.weight": torch.zeros(98, 64)})


def test_a_tied_checkpoints_extra_lm_head_is_skipped():
    tied = ModelConfig.from_hf_dict(dict(vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, tie_word_embeddings=True))
    w = {n: torch.ones(s) for n, s in LLAMA.weight_shapes(tied).items()}
    LlamaForCausalLM(tied, 16, parallel=RANK1).load_weights((w | {"lm_head.weight": torch.zeros(99, 64)}).items())


def q4(rows: int, cols: int, seed: int) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    return Q4Weight(torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32),
                    torch.rand(rows, cols // 32, generator=g), torch.rand(rows, cols // 32, generator=g))


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="no int4 CPU kernel")
def test_int4_parts_are_sliced_like_the_dense_weights():
    """Rank 1 of 2: q|k|v, gate|up and o_proj keep 4-bit rows/columns of their slice; down_proj's
    slice of 96 / 2 = 48 input columns would cut a 32-block, so it stays dense."""
    model = LlamaForCausalLM(CFG, 16, parallel=RANK1)
    parts = {n: q4(*s, i) for i, (n, s) in enumerate(LLAMA.weight_shapes(CFG).items())
             if n.endswith("proj.weight")}
    assert model.load_int4(parts.items()) == 3
    attn, mlp, p = model.layers[0].self_attn, model.layers[0].mlp, "model.layers.0."
    qkv = [parts[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
    want = {attn.qkv_proj: Q4Weight(*(torch.cat([second_half(getattr(w, f)) for w in qkv]) for f in ("q", "scale", "zero"))),
            attn.o_proj: Q4Weight(*(second_half(getattr(parts[p + "self_attn.o_proj.weight"], f), 1)
                                    for f in ("q", "scale", "zero")))}
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    for layer, w in want.items():
        x_in = x if layer is attn.qkv_proj else x[:, :32].contiguous()
        ref = x_in @ w.dequantize().t()
        assert (layer.project(x_in, None) - ref).abs().max() <= 1e-3 * ref.abs().max()  # the int4 kernel
    assert mlp.gate_up_proj.int4 is not None and mlp.down_proj.int4 is None
