"""The MoE layer (ketch/layers/moe.py, moe_routing.py): routing against HF transformers' own
routers (Qwen3-MoE, Mixtral, DeepSeek V2 and V3) on random inputs; the reference expert
computation against a per-token loop; the module's per-expert loading. (TP=2 against TP=1: the
MoE models in tests/test_parallel_llama.py.)"""
from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from ketch.layers.moe import MoE, dense_experts_ref, fused_experts_ref
from ketch.layers.moe_routing import grouped_topk, softmax_topk
from ketch.parallel import SINGLE, ParallelContext

TOKENS, HIDDEN = 37, 32


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The picks of each token in expert order (the order of the k picks is free)."""
    ids, order = ids.sort(dim=-1)
    return weights.float().gather(1, order), ids


def assert_same_routing(got, ref) -> None:
    (w, i), (rw, ri) = by_expert(*got), by_expert(*ref)
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


def hf_route(router, x: torch.Tensor, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        router.weight.normal_(0, 1)
        _, weights, ids = router(x)
    return F.linear(x, router.weight), (weights, ids)


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_topk_is_qwen3_moe_router(norm):
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    logits, ref = hf_route(Qwen3MoeTopKRouter(cfg), x, seed=2)
    assert_same_routing(softmax_topk(logits, 4, renormalize=norm), ref)


def test_softmax_topk_is_mixtral_router():
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, num_local_experts=8, num_experts_per_tok=2)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    logits, ref = hf_route(MixtralTopKRouter(cfg), x, seed=4)
    assert_same_routing(softmax_topk(logits, 2, renormalize=True), ref)  # Mixtral always renormalises


@pytest.mark.parametrize("norm,scale,n_group,topk_group", [(True, 2.5, 4, 2), (False, 1.0, 8, 3), (True, 1.0, 1, 1)])
def test_grouped_topk_is_deepseek_v3_router(norm, scale, n_group, topk_group):
    """noaux_tc: sigmoid scores, the correction bias for the choice only, groups by their top-2 sum."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=32, num_experts_per_tok=4, n_group=n_group,
                                        topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm)
    router = DeepseekV3TopkRouter(cfg)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(5))  # large enough to change picks
    router.e_score_correction_bias.copy_(bias)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    logits, ref = hf_route(router, x, seed=7)
    got = grouped_topk(logits, 4, n_group=n_group, topk_group=topk_group, scoring="sigmoid", correction_bias=bias,
                       renormalize=norm, routed_scaling_factor=scale)
    assert_same_routing(got, ref)
    unbiased = grouped_topk(logits, 4, n_group=n_group, topk_group=topk_group, scoring="sigmoid")
    assert not torch.equal(by_expert(*unbiased)[1], by_expert(*got)[1])  # the bias does pick other experts


@pytest.mark.parametrize("method,n_group,topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2)])
def test_grouped_topk_is_deepseek_v2_router(method, n_group, topk_group):
    """Softmax scores; groups by their best expert. HF's V2 router never renormalises (V2's
    released configs say norm_topk_prob false) and always scales."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = transformers.DeepseekV2Config(hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=3,
                                        n_group=n_group, topk_group=topk_group, topk_method=method,
                                        routed_scaling_factor=16.0)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    logits, ref = hf_route(DeepseekV2TopkRouter(cfg), x, seed=9)
    got = grouped_topk(logits, 3, n_group=n_group, topk_group=topk_group, scoring="softmax",
                       routed_scaling_factor=16.0)
    assert_same_routing(got, ref)


def test_grouped_topk_rejects_bad_groups_and_scoring():
    logits = torch.randn(3, 12)
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk(logits, 2, n_group=5, topk_group=1)
    with pytest.raises(ValueError, match="scoring_func"):
        grouped_topk(logits, 2, scoring="tanh")


def naive_experts(x, w13, w2, weights, ids):
    """Token by token, pick by pick."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(experts: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return 0.2 * torch.randn(experts, 2 * inter, HIDDEN, generator=g), 0.2 * torch.randn(experts, HIDDEN, inter, generator=g)


def test_fused_experts_ref_is_the_per_token_sum():
    w13, w2 = random_experts(8, 24)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10))
    logits = torch.randn(TOKENS, 8, generator=torch.Generator().manual_seed(11))
    logits[:, 3] = float("-inf")  # expert 3 gets no rows: it is skipped
    weights, ids = softmax_topk(logits, 2, True)
    got = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, naive_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert fused_experts_ref(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, HIDDEN)


def expert_checkpoint(experts: int, inter: int) -> dict[tuple[int, str], torch.Tensor]:
    """Each expert's full gate ("w1"), up ("w3") [inter, hidden] and down ("w2") [hidden, inter]."""
    w13, w2 = random_experts(experts, inter, seed=12)
    return {**{(e, "w1"): w13[e, :inter] for e in range(experts)}, **{(e, "w3"): w13[e, inter:] for e in range(experts)},
            **{(e, "w2"): w2[e] for e in range(experts)}}


def build_moe(parallel: ParallelContext) -> MoE:
    moe = MoE(HIDDEN, 8, 24, partial(softmax_topk, top_k=2, renormalize=True), parallel=parallel)
    moe.gate.weight.data.copy_(torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(13)))
    for (e, part), t in expert_checkpoint(8, 24).items():
        param = moe.experts.w2 if part == "w2" else moe.experts.w13
        moe.experts.weight_loader(param, t, (e, part))
    return moe


def test_moe_module_loads_each_expert_and_matches_the_reference():
    moe = build_moe(SINGLE)
    ckpt = expert_checkpoint(8, 24)
    w13 = torch.stack([torch.cat((ckpt[(e, "w1")], ckpt[(e, "w3")])) for e in range(8)])
    w2 = torch.stack([ckpt[(e, "w2")] for e in range(8)])
    assert torch.equal(moe.experts.w13, w13) and torch.equal(moe.experts.w2, w2)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(14))
    weights, ids = softmax_topk(F.linear(x, moe.gate.weight), 2, True)
    torch.testing.assert_close(moe(x), naive_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expert 8"):
        moe.experts.weight_loader(moe.experts.w2, ckpt[(0, "w2")], (8, "w2"))
    with pytest.raises(ValueError, match="does not belong"):
        moe.experts.weight_loader(moe.experts.w13, ckpt[(0, "w2")], (0, "w2"))


def test_dense_experts_ref_is_fused_experts_ref():
    """The graph-capture path (every expert on every token, unpicked ones weighted 0)."""
    w13, w2 = random_experts(8, 24)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(15))
    weights, ids = softmax_topk(torch.randn(TOKENS, 8, generator=torch.Generator().manual_seed(16)), 3, False)
    torch.testing.assert_close(dense_experts_ref(x, w13, w2, weights, ids), fused_experts_ref(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2])
def test_shared_experts_fold_into_the_fused_experts(world):
    """DeepSeek's shared MLP (S x I features) loaded into S expert slots after the routed ones
    and picked by every token at weight 1 (append_picks) is the routed sum plus the MLP; under
    tensor parallelism each rank holds its half of every slot and the ranks' partial sums add up."""
    from ketch.layers.moe import SHARED, FusedExperts
    from ketch.layers.moe_routing import append_picks

    experts, inter, shared = 8, 24, 2
    ckpt = expert_checkpoint(experts, inter)
    g = torch.Generator().manual_seed(17)
    gate, up = (0.2 * torch.randn(shared * inter, HIDDEN, generator=g) for _ in range(2))
    down = 0.2 * torch.randn(HIDDEN, shared * inter, generator=g)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    weights, ids = softmax_topk(torch.randn(TOKENS, experts, generator=g), 2, True)
    total = torch.zeros(TOKENS, HIDDEN)
    for rank in range(world):
        layer = FusedExperts(experts, HIDDEN, inter, parallel=ParallelContext(rank, world), shared=shared)
        assert layer.param_shard_ids("w2")[-1] == (SHARED, "w2")
        for (e, part), t in ckpt.items():
            layer.weight_loader(layer.w2 if part == "w2" else layer.w13, t, (e, part))
        for part, t in (("w1", gate), ("w3", up), ("w2", down)):
            layer.weight_loader(layer.w2 if part == "w2" else layer.w13, t, (SHARED, part))
        total += fused_experts_ref(x, layer.w13, layer.w2, *append_picks(weights, ids, experts, shared))
    w13 = torch.stack([torch.cat((ckpt[(e, "w1")], ckpt[(e, "w3")])) for e in range(experts)])
    w2 = torch.stack([ckpt[(e, "w2")] for e in range(experts)])
    want = naive_experts(x, w13, w2, weights, ids) + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="should be 2 x 24"):
        layer.weight_loader(layer.w13, gate[:inter], (SHARED, "w1"))
    with pytest.raises(ValueError, match="names expert 8"):  # a shared slot is loaded by SHARED only
        layer.weight_loader(layer.w2, ckpt[(0, "w2")], (8, "w2"))
