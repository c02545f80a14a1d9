"""MLA's two forms of one product, YaRN's three numbers against HF transformers, and the released
DeepSeek-V2-Lite config (configs/deepseek-v2-lite): parsed, its latent sized, its MoE layers'
routing and published parameter counts. No model is generated from here (that is
tests/test_deepseek_models.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ketch.attention.mla_backend import mla_absorbed, mla_expanded
from ketch.config import KVSpec, KVTensorSpec
from ketch.layers.yarn import YarnScaling
from ketch.models.deepseek_family import DEEPSEEK, LATENT, DeepseekConfig
from ketch.models.registry import family_for, load_model_config
from ketch.parallel import SINGLE, ExpertParallel, ParallelContext

V2_LITE = Path(__file__).resolve().parent.parent / "configs" / "deepseek-v2-lite"


def naive_mla(q, latent, visible, w_uk, w_uv, scale):
    """Per head: K = [W_UK c | k_pe], V = W_UV c, softmax(q K^T * scale) V, written out in float64."""
    q, latent, w_uk, w_uv = (t.double() for t in (q, latent, w_uk, w_uv))
    rank = w_uk.shape[2]
    c, k_pe = latent[..., :rank], latent[..., rank:]
    out = []
    for h in range(w_uk.shape[0]):
        k = torch.cat((c @ w_uk[h].T, k_pe), -1)  # [B, L, nope + rope]
        s = (q[:, h] @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out.append(s.softmax(-1) @ (c @ w_uv[h].T))
    return torch.stack(out, 1)


@pytest.mark.parametrize("shift", [0, 5], ids=["causal", "after-a-cached-prefix"])
def test_absorbed_decode_equals_expanded_form(shift):
    gen = torch.Generator().manual_seed(shift)
    heads, nope, rope, v, rank, n, pad = 4, 32, 16, 24, 40, 6, 3
    length = shift + n
    q = torch.randn(2, heads, n, nope + rope, generator=gen)
    latent = torch.randn(2, length + pad, rank + rope, generator=gen)  # page padding past the sequence
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=gen) / 6, torch.randn(heads, v, rank, generator=gen) / 6
    visible = torch.arange(length + pad)[None, :] <= torch.arange(shift, length)[:, None]  # [n, L]
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
    scale = 0.11
    expected = naive_mla(q, latent, visible, w_uk, w_uv, scale)
    expanded = mla_expanded(q, latent, mask, w_uk, w_uv, scale)
    absorbed = mla_absorbed(q, latent, mask, w_uk, w_uv, scale)
    assert expanded.shape == absorbed.shape == (2, heads, n, v)
    torch.testing.assert_close(absorbed, expanded, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(absorbed.double(), expected, atol=2e-5, rtol=1e-5)
    if shift == 0:  # the expanded form's own causal path (no mask, no padding)
        causal = mla_expanded(q, latent[:, :n], None, w_uk, w_uv, scale)
        torch.testing.assert_close(causal, expanded, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2-Lite's
    {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.9},
    {"factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2},  # no mscale
    {"factor": 8.0, "original_max_position_embeddings": 128, "attention_factor": 1.3, "mscale_all_dim": 1.0},
], ids=["v2-lite", "both-mscales", "no-mscale", "attention-factor"])
def test_yarn_matches_hf(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    hf_cfg = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                           qk_rope_head_dim=16, qk_nope_head_dim=32, max_position_embeddings=512,
                                           rope_parameters=rope)
    inv_freq, rope_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = DeepseekConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    assert isinstance(ours.yarn, YarnScaling)
    torch.testing.assert_close(ours.yarn.inverse_frequencies(16, 10000.0), inv_freq, atol=0, rtol=1e-6)
    assert ours.yarn.rope_factor == pytest.approx(rope_factor, rel=1e-12)
    hf_attn = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, 0)
    assert ours.softmax_scale == pytest.approx(hf_attn.scaling, rel=1e-12)


def test_v2_lite_config_parses_with_its_moe_layers():
    cfg = load_model_config(str(V2_LITE))
    assert isinstance(cfg, DeepseekConfig) and family_for(cfg.architecture) is DEEPSEEK
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (None, 512, 192, 128)
    assert cfg.rope_interleave and cfg.yarn is not None and cfg.yarn.rope_factor == 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2, rel=1e-12)
    # 576 values per layer and token: the latent of MLA, not 2 x 16 heads x (192 | 128)
    assert DEEPSEEK.kv_spec(cfg, SINGLE) == KVSpec(27, (KVTensorSpec(LATENT, (576,)),))
    assert [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)] == list(range(1, 27))
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.moe_intermediate_size) == \
        (64, 6, 2, 1408)
    assert (cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        ("greedy", 1, 1, False, 1.0)
    # the published sizes: 15.7 B parameters, 2.4 B active per token (6 of 64 routed experts;
    # the input embedding, a lookup, not counted)
    shapes = DEEPSEEK.weight_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    routed = sum(math.prod(s) for k, s in shapes.items() if ".mlp.experts." in k)
    assert total == pytest.approx(15.7e9, rel=0.01)
    active = total - routed * (1 - 6 / 64) - math.prod(shapes["model.embed_tokens.weight"])
    assert active == pytest.approx(2.4e9, rel=0.03)
    assert shapes["model.layers.26.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (2 * 1408, 2048)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in shapes  # V2: no noaux_tc


def test_v2_lite_dense_prefix_shapes_match_hf_names():
    """With every layer dense (first_k_dense_replace = layers), our checkpoint names and shapes
    are exactly HF's DeepseekV2 state dict (meta device: nothing is allocated)."""
    import transformers

    d = json.loads((V2_LITE / "config.json").read_text())
    d.update(num_hidden_layers=2, first_k_dense_replace=2, vocab_size=1000)
    hf_cfg = transformers.DeepseekV2Config(**{k: v for k, v in d.items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert DEEPSEEK.weight_shapes(DeepseekConfig.from_hf(d)) == want


def test_the_latent_is_whole_on_every_rank_and_gqa_configs_are_refused():
    """Under tensor parallelism each rank's pool holds the whole latent (it serves all heads:
    tests/test_tp_deepseek.py runs TP=2); a config with grouped kv heads is not MLA."""
    cfg = load_model_config(str(V2_LITE))
    assert DEEPSEEK.kv_spec(cfg, ParallelContext(0, 2)) == DEEPSEEK.kv_spec(cfg, ParallelContext(0, 1))
    # its 16 heads over 3 ranks: refused (the engine asks before the ranks start), but not under
    # DP attention, where every rank has all the heads
    with pytest.raises(ValueError, match="^num_attention_heads: 16 does not split evenly over tensor parallel size 3"):
        DEEPSEEK.kv_spec(cfg, ParallelContext(0, 3))
    assert DEEPSEEK.kv_spec(cfg, ParallelContext(0, 3, ep=ExpertParallel(3, dp_attention=True))) == \
        DEEPSEEK.kv_spec(cfg, SINGLE)
    d = json.loads((V2_LITE / "config.json").read_text())
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DeepseekConfig.from_hf({**d, "num_key_value_heads": 4})
