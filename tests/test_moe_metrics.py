"""Per-expert routed-token counters of MoE models (issue 19 item 5) on /metrics, with
--enable-expert-distribution-metrics (off by default: layers x experts series): for each sparse
layer (labelled with its decoder layer) and expert, the (token, pick)s routed to it since start-up.
Every token run through the model picks top_k experts in every sparse layer, so each layer's sum
is exactly computed tokens × top_k, with dense layers absent; an EPLB window reset leaves the
totals growing; the counters survive the engine-to-API message and render as Prometheus
counters. Tiny random Qwen3-MoE and DeepSeek-V3 checkpoints (`from_config` + `save_pretrained`)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ketch.engine import messages as m
from ketch.layers.eplb_runtime import ExpertLoad
from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from ketch.server.metrics import ServerMetrics
from ketch.weights.source import default_model_path
from server_util import parse_metrics

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3, eos_token_id=299,
              bos_token_id=1, num_hidden_layers=3)
CHECKPOINTS = {  # (config class, its fields, the sparse layers, top_k)
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                         mlp_only_layers=[1]), (0, 2), 2),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
                                             qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8,
                                             num_experts_per_tok=3, moe_intermediate_size=16, first_k_dense_replace=1,
                                             n_shared_experts=1, n_group=4, topk_group=2), (1, 2), 3),
}
PROMPTS = [[5 + i for i in range(n)] for n in (7, 19, 4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def served(request, tmp_path_factory):
    """(engine stats after the prompts ran, sparse layers, top_k)"""
    import transformers

    cls, fields, sparse, top_k = CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**COMMON, **fields})
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    llm = LLM(str(path), tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
              kv_cache_memory=4 << 20, page_size=8, enable_expert_distribution_metrics=True)
    try:
        llm.generate(PROMPTS, PARAMS)
        return llm.engine.stats(), sparse, top_k
    finally:
        llm.close()


def test_off_by_default(tmp_path):
    """Without --enable-expert-distribution-metrics a MoE model's stats carry no series."""
    import transformers

    cls, fields, _, _ = CHECKPOINTS["qwen3_moe"]
    torch.manual_seed(0)
    cfg = getattr(transformers, cls)(**{**COMMON, **fields})
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
              kv_cache_memory=4 << 20, page_size=8)
    try:
        llm.generate(PROMPTS[:1], PARAMS)
        stats = llm.engine.stats()
    finally:
        llm.close()
    assert stats.moe_layers == () and "ketch_moe_expert_tokens" not in ServerMetrics().render(stats).decode()


def test_each_sparse_layer_counts_top_k_picks_of_every_computed_token(served):
    stats, sparse, top_k = served
    assert stats.moe_layers == sparse  # the decoder layers' own numbers; dense layers have no row
    assert stats.computed_tokens == sum(map(len, PROMPTS)) + len(PROMPTS) * (PARAMS.max_tokens - 1)
    for layer, counts in zip(stats.moe_layers, stats.moe_expert_tokens, strict=True):
        assert sum(counts) == stats.computed_tokens * top_k, layer
        assert sum(c > 0 for c in counts) > 1  # picks spread over experts (a layer is not one counter)


def test_the_counters_cross_the_wire_and_render_as_prometheus_counters(served):
    stats, sparse, top_k = served
    pong = m.decode_from_engine(m.encode(m.Pong(1, stats)))
    assert pong.stats == stats  # msgspec carries the nested tuples as they are
    text = ServerMetrics().render(pong.stats).decode()
    metrics = parse_metrics(text)
    series = {k: v for k, v in metrics.items() if k.startswith("ketch_moe_expert_tokens_total{")}
    assert len(series) == len(sparse) * len(stats.moe_expert_tokens[0])
    for layer, counts in zip(sparse, stats.moe_expert_tokens, strict=True):
        for expert, n in enumerate(counts):
            assert series[f'ketch_moe_expert_tokens_total{{expert="{expert}",layer="{layer}"}}'] == n
    types = [line for line in text.splitlines() if line.startswith("# TYPE ketch_moe_expert_tokens")]
    assert len(types) == 1 and types[0].endswith(" counter"), types


def test_a_dense_model_has_no_expert_series(tiny_config_path):
    from conftest import make_tiny_engine

    stats = make_tiny_engine(tiny_config_path).stats()
    assert stats.moe_layers == () and stats.moe_expert_tokens == ()
    assert "ketch_moe_expert_tokens" not in ServerMetrics().render(stats).decode()


class FixedRouter(nn.Module):
    """Routes every token to experts (0, 3)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([[0, 3]]).expand(x.shape[0], 2)
        return torch.full(ids.shape, 0.5), ids


def test_an_eplb_window_reset_restarts_the_planners_load_and_not_the_totals():
    routers = [FixedRouter(), FixedRouter()]
    load = ExpertLoad(routers, num_experts=4, layer_ids=[1, 5])
    for r in routers:
        r(torch.zeros(3, 8))
    load.reset()  # what Eplb.rebalance does after it planned
    for r in routers:
        r(torch.zeros(2, 8))
    assert load.snapshot().tolist() == [[2, 0, 0, 2]] * 2  # the window: since the reset
    assert load.totals() == [[5, 0, 0, 5]] * 2  # /metrics: since the start
    with pytest.raises(ValueError, match="layer_ids"):
        ExpertLoad(routers, num_experts=4, layer_ids=[1])
