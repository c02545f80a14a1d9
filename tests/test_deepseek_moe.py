"""DeepSeek's mixture-of-experts layers beyond the HF comparison (tests/test_deepseek_models.py):
the router's two tensors stay fp32 in a bf16 model, the released configs (V2-Lite, V3) load with
dummy weights when cut small, V3's published sizes (671 B parameters, 37 B active) and KV, and
routing settings the family refuses."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import assert_drained
from ketch.config import KVSpec, KVTensorSpec
from ketch.llm import LLM
from ketch.models.deepseek_family import DEEPSEEK, LATENT, DeepseekConfig
from ketch.models.registry import load_model_config
from ketch.parallel import SINGLE
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, n_shared_experts=1, n_group=4, topk_group=2, eos_token_id=299)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(path, tokenizer=default_model_path(), page_size=8, kv_cache_memory=4 << 20, **kw)


def test_router_stays_fp32_in_a_bf16_model(tmp_path):
    """gate.weight and e_score_correction_bias are HF's fp32-in-any-dtype tensors: read from the
    checkpoint in fp32 (not through bf16) and held in fp32, whatever the model's dtype; the
    experts and everything else are bf16."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**TINY), dtype=torch.float32)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(torch.rand(bias.shape) / 3 + 1 / 3)  # no bf16 holds these
    assert not torch.equal(bias.bfloat16().float(), bias)
    hf.save_pretrained(tmp_path)
    llm = make_llm(str(tmp_path), dtype="bfloat16")
    model = llm.engine.runner.model
    gate = model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == gate.weight.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, bias)
    assert torch.equal(gate.weight, hf.model.layers[1].mlp.gate.weight)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"layers.1.mlp.gate.weight", "layers.1.mlp.gate.e_score_correction_bias"}
    assert len(llm.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids) == 4
    assert_drained(llm.engine)
    dummy = make_llm(str(tmp_path / "config.json"), dtype="bfloat16", load_format="dummy").engine.runner.model
    gate = dummy.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert not torch.equal(gate.weight.bfloat16().float(), gate.weight)  # drawn in fp32, not bf16


def cut_small(name: str, tmp_path: Path, **extra) -> str:
    """configs/<name> with small layers, its routing settings (experts, groups, k, scaling) kept."""
    d = json.loads((CONFIGS / name / "config.json").read_text())
    d.update(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=96,
             moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=512, **extra)
    if d.get("q_lora_rank"):
        d["q_lora_rank"] = 48
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_dummy_weights_of_the_configs_cut_small(name, tmp_path):
    """`--load-format dummy` draws every tensor `weight_shapes` names (routed and shared experts,
    V3's correction bias) and the model loads them all and generates."""
    path = cut_small(name, tmp_path)
    cfg = load_model_config(path, "dummy")
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    llm = make_llm(path, load_format="dummy")
    assert len(llm.generate([[5, 6, 7, 8]], GREEDY)[0].token_ids) == 4
    assert_drained(llm.engine)


def test_v3_config_published_sizes_and_kv():
    """configs/deepseek-v3 (the released config.json): 671 B parameters without the
    multi-token-prediction layer (which ketch skips), 37 B active per token (8 of 256 routed
    experts; the input embedding, a lookup, not counted), one 576-value latent per layer."""
    cfg = load_model_config(str(CONFIGS / "deepseek-v3"), "dummy")
    assert isinstance(cfg, DeepseekConfig)
    assert (cfg.topk_method, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == ("noaux_tc", 8, 4, 8)
    assert (cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts) == (True, 2.5, 1)
    assert [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)] == [0, 1, 2]
    assert DEEPSEEK.kv_spec(cfg, SINGLE) == KVSpec(61, (KVTensorSpec(LATENT, (576,)),))
    shapes = DEEPSEEK.weight_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values())
    routed = sum(math.prod(s) for k, s in shapes.items() if ".mlp.experts." in k)
    assert total == pytest.approx(671e9, rel=0.005)
    active = total - routed * (1 - 8 / 256) - math.prod(shapes["model.embed_tokens.weight"])
    assert active == pytest.approx(37e9, rel=0.02)
    assert shapes["model.layers.60.mlp.gate.e_score_correction_bias"] == (256,)


@pytest.mark.parametrize("name,change,match", [
    ("deepseek-v3", {"topk_method": "greedy"}, "noaux_tc"),  # HF's V3 would route noaux_tc anyway
    ("deepseek-v3", {"scoring_func": "softmax"}, "sigmoid"),
    ("deepseek-v2-lite", {"topk_method": "noaux_tc"}, "greedy or group_limited_greedy"),
    ("deepseek-v2-lite", {"scoring_func": "sigmoid"}, "softmax"),
    ("deepseek-v3", {"n_group": 3}, "n_group"),
    ("deepseek-v3", {"topk_group": 9}, "topk_group"),
    ("deepseek-v3", {"num_experts_per_tok": 300}, "num_experts_per_tok: 300 of 256"),
    ("deepseek-v3", {"num_experts_per_tok": 140}, "exceeds the experts of 4 groups"),
], ids=["v3-method", "v3-scoring", "v2-method", "v2-scoring", "groups", "topk-group", "k", "k-groups"])
def test_routing_settings_the_family_refuses(name, change, match):
    d = json.loads((CONFIGS / name / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        DeepseekConfig.from_hf({**d, **change})
    assert DeepseekConfig.from_hf({**d, **change, "first_k_dense_replace": d["num_hidden_layers"]})  # all dense
