"""The MoE routing-side kernels against their torch references: the one-launch alignment
(ketch/kernels/moe_align.py `moe_align` vs `moe_align_ref`, every output equal) and the softmax
top-k routing kernel (ketch/kernels/moe_route.py vs ketch.layers.moe_routing.softmax_topk).

Without CUDA the kernels run in Triton's CPU interpreter (fp32 only there); with CUDA compiled.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels.moe_align import ALIGN_KERNEL_MAX_ROWS, moe_align, moe_align_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EMPTY = 3  # an expert no token picks


def random_ids(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """k distinct experts per token, expert EMPTY never picked."""
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed))
    scores[:, EMPTY] = -1.0
    return scores.topk(top_k, dim=-1).indices.to(DEVICE)


@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_kernel_is_the_torch_align(tokens, experts, top_k, block_m):
    ids = random_ids(tokens, experts, top_k, seed=tokens * experts + block_m)
    assert tokens * top_k <= ALIGN_KERNEL_MAX_ROWS  # the kernel's side of the threshold
    got, ref = moe_align(ids, experts, block_m), moe_align_ref(ids, experts, block_m)
    for name, g, r in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, ref, strict=True):
        assert g.dtype == r.dtype == torch.int32 and g.shape == r.shape, name
        assert torch.equal(g.cpu(), r.cpu()), name
    assert EMPTY not in got[1].tolist()


def test_align_kernel_int32_ids_and_one_expert_many_blocks():
    """int32 ids (the kernel reads any integer type) and one expert's run spanning blocks."""
    ids = torch.full((40, 2), 5, dtype=torch.int32, device=DEVICE)
    ids[:, 1] = 6
    ids[7, 1] = 0
    for g, r in zip(moe_align(ids, 8, 16), moe_align_ref(ids, 8, 16), strict=True):
        assert torch.equal(g.cpu(), r.cpu())


@pytest.mark.parametrize("experts,top_k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_kernel_is_softmax_topk(experts, top_k, renormalize):
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import softmax_topk

    logits = 3.0 * torch.randn(37, experts, generator=torch.Generator().manual_seed(experts + renormalize))
    logits[5, EMPTY] = float("-inf")  # an expert at probability 0
    logits[6] -= 100.0  # every logit negative (the kernel's max compares float bits as integers)
    logits[7] += 100.0  # every logit positive
    weights, ids = softmax_topk_triton(logits.to(DEVICE), top_k, renormalize)
    ref_w, ref_ids = softmax_topk(logits, top_k, renormalize)
    assert weights.dtype == ref_w.dtype and ids.dtype == ref_ids.dtype and ids.shape == ref_ids.shape
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(37), atol=1e-6, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("append", [1, 2])
def test_routing_kernel_scales_and_appends_the_shared_experts(renormalize, append):
    """DeepSeek-V2: the routed weights times routed_scaling_factor, then the shared experts as
    always-picked slots E, E+1, ... at weight 1 (append_picks, the reference)."""
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import append_picks, softmax_topk

    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(append))
    weights, ids = softmax_topk_triton(logits.to(DEVICE), 6, renormalize, scale=2.5, append=append)
    ref_w, ref_ids = softmax_topk(logits, 6, renormalize)
    ref_w, ref_ids = append_picks(ref_w * 2.5, ref_ids, 16, append)
    assert ids.shape == (9, 6 + append) and ids[:, 6:].tolist() == [list(range(16, 16 + append))] * 9
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=0)
    assert torch.equal(weights[:, 6:].cpu(), torch.ones(9, append))
    assert append_picks(ref_w, ref_ids, 16, 0) == (ref_w, ref_ids)


def test_routing_kernel_adds_its_routed_picks_to_the_counts():
    """ExpertLoad's counters (/metrics, EPLB) in the routing launch: each routed pick adds 1 to
    its expert's count, on top of what is there; the appended shared slots are not counted."""
    from ketch.kernels.moe_route import softmax_topk_triton

    logits = torch.randn(23, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    counts = torch.arange(20, dtype=torch.int64, device=DEVICE)  # earlier steps' counts
    _, ids = softmax_topk_triton(logits, 4, True, append=2, counts=counts)
    want = torch.arange(20) + torch.bincount(ids[:, :4].reshape(-1).cpu(), minlength=20)
    assert torch.equal(counts.cpu(), want) and int(counts.sum()) == sum(range(20)) + 23 * 4
    for bad in (counts.int(), counts[:15], counts.view(4, 5)):
        with pytest.raises(ValueError, match="counts"):
            softmax_topk_triton(logits, 4, True, counts=bad)


def test_routing_kernel_strided_logits_and_no_tokens():
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import softmax_topk

    wide = torch.randn(6, 20, generator=torch.Generator().manual_seed(9))
    weights, ids = softmax_topk_triton(wide[:, :12].to(DEVICE), 3, True)  # row stride 20
    ref_w, ref_ids = softmax_topk(wide[:, :12], 3, True)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=0)
    weights, ids = softmax_topk_triton(torch.empty(0, 12, device=DEVICE), 3, True)
    assert weights.shape == ids.shape == (0, 3)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_triton(wide, 21, True)


def test_routing_kernel_ties_pick_the_lowest_index():
    from ketch.kernels.moe_route import softmax_topk_triton

    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0, 0.0]], device=DEVICE)
    weights, ids = softmax_topk_triton(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 3]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]


def test_the_moe_model_routes_through_the_layer_ops_kernel(tmp_path):
    """Qwen3-MoE's sparse layers pick their router function at build: the Triton ops' kernel
    (the end-to-end token check is test_fused_moe_kernel.py's model test), torch's otherwise."""
    import json
    from pathlib import Path

    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import softmax_topk
    from ketch.layers.ops import TORCH_OPS, triton_ops
    from ketch.models.moe_model import MoEForCausalLM
    from ketch.models.registry import load_model_config

    d = json.loads((Path(__file__).resolve().parents[1] / "configs" / "qwen3-30b-a3b" / "config.json").read_text())
    d.update(num_hidden_layers=1, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, num_experts=8)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_model_config(str(tmp_path / "config.json"), "dummy")
    for ops, want in ((triton_ops(), softmax_topk_triton), (TORCH_OPS, softmax_topk)):
        select = MoEForCausalLM(cfg, 64, ops=ops).layers[0].mlp.gate.select
        assert select.func is want and select.keywords == dict(top_k=8, renormalize=cfg.norm_topk_prob)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter's bf16 loads are wrong")
def test_routing_kernel_bf16_logits():
    """bf16 router logits (the model's): same weights; ids may differ from torch's only on exact
    ties (bf16 makes them common), so the check is that each picked expert has its weight."""
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import softmax_topk

    logits = torch.randn(64, 128, device=DEVICE).to(torch.bfloat16)
    weights, ids = softmax_topk_triton(logits, 8, True)
    ref_w, _ = softmax_topk(logits, 8, True)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=0)
    probs = torch.softmax(logits.float(), dim=-1).gather(1, ids)
    torch.testing.assert_close(probs / probs.sum(-1, keepdim=True), weights, atol=1e-6, rtol=0)
    assert bool((ids.sort(-1).values.diff(dim=-1) > 0).all()), "k distinct experts"


@pytest.mark.parametrize("method,n_group,topk_group,scale,kernel", [
    ("greedy", 1, 1, 1.0, True),  # V2-Lite's
    ("group_limited_greedy", 4, 4, 2.5, True),  # every group kept: nothing masked
    ("group_limited_greedy", 4, 2, 1.0, False),  # groups masked: torch's grouped top-k
    ("noaux_tc", 1, 1, 1.0, False),  # V3's sigmoid + bias
])
def test_deepseek_routing_uses_the_kernel_where_no_group_is_masked(tmp_path, method, n_group, topk_group, scale,
                                                                   kernel):
    """DeepSeek-V2 routing that masks no group is softmax top-k times the scaling factor: with the
    Triton layer ops it runs the one-launch kernel and gives grouped_topk's experts and weights;
    group masking and V3's noaux_tc stay on torch's grouped_topk."""
    import json
    from pathlib import Path

    from ketch.layers.moe_routing import grouped_topk
    from ketch.layers.ops import TORCH_OPS, triton_ops
    from ketch.kernels.moe_route import softmax_topk_triton
    from ketch.layers.moe_routing import append_picks
    from ketch.models.deepseek_moe import routing
    from ketch.models.registry import load_model_config

    d = json.loads((Path(__file__).resolve().parents[1] / "configs" / "deepseek-v2-lite" / "config.json").read_text())
    d.update(topk_method=method, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    if method == "noaux_tc":
        d.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", scoring_func="sigmoid")
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_model_config(str(tmp_path / "config.json"), "dummy")
    select = routing(cfg, triton_ops())
    assert (select.func is softmax_topk_triton) == kernel
    assert routing(cfg, TORCH_OPS).func is grouped_topk and routing(cfg).func is grouped_topk
    logits = 3.0 * torch.randn(37, 64, generator=torch.Generator().manual_seed(n_group + topk_group))
    bias = {"correction_bias": torch.zeros(64)} if method == "noaux_tc" else {}
    ref_w, ref_ids = routing(cfg)(logits, **bias)
    # the shared experts folded in (2 slots after the 64 routed): the kernel appends them in its
    # launch, the torch path after grouped_topk
    on_device = {name: t.to(DEVICE) for name, t in bias.items()}
    for appended in (0, 2):
        weights, ids = routing(cfg, triton_ops(), appended)(logits.to(DEVICE), **on_device)
        want_w, want_ids = append_picks(ref_w, ref_ids, 64, appended)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(weights.cpu(), want_w, atol=1e-6, rtol=0)
