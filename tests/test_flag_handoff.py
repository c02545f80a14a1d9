"""A one-token MoE step as a flag chain (ketch/kernels/handoff.py): the routing kernel heads it,
the gate|up GEMM waits on slot A and counts into slot B, the down GEMM waits on B and resets A.

The outputs must be the chain-less launches' bit for bit (the flags move no arithmetic), and the
slots must end every step as the next one needs them (A back at 0, B at the gate|up launch's
program count, B zeroed again by the next head): in the interpreter, which runs launches one after
another, the waits pass at once, so the end states are what shows a reset missing or misplaced.
Natively (CUDA) the same tests run the chain for real, eagerly and in a CUDA graph.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels import fused_moe, handoff, moe_decode, moe_route_up
from ketch.kernels.fused_moe import FLAGS_MIDDLE, GemmConfig, moe_gemm
from ketch.kernels.moe_route import softmax_topk_triton
from ketch.kernels.moe_route_up import routed_experts_triton
from test_moe_route_up_kernel import DEVICE, H, I, case  # one token's x, logits and expert weights


@pytest.fixture(autouse=True)
def chain_path(monkeypatch):
    """The two-launch path at one token (routing kernel, then the direct GEMMs), slots fresh."""
    monkeypatch.setattr(moe_decode, "DECODE_MAX_TOKENS", 0)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_TOKENS", 1)
    monkeypatch.setattr(moe_route_up, "ENABLED", False)
    handoff.reset_all()
    yield
    handoff.reset_all()


def up_programs(picks: int, w13: torch.Tensor, tokens: int = 1) -> int:
    cfg = fused_moe.pick_config(tokens, w13.shape[0], w13.shape[2], w13.shape[1] // 2, picks, "16")
    return picks * -(-(w13.shape[1] // 2) // cfg.up.block_n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("experts,top_k,append,sum_picks", [
    (8, 2, 0, True),  # Mixtral-like, summed
    (12, 3, 2, False),  # DeepSeek-V2-like: two shared experts appended, picks left to the norm
])
def test_chain_gives_the_same_bits_and_leaves_the_slots_ready(dtype, experts, top_k, append, sum_picks, monkeypatch):
    x, logits, w13, w2 = case(experts, experts + append, dtype, seed=experts)
    route = dict(top_k=top_k, renormalize=True, scale=1.5, append=append, sum_picks=sum_picks)
    monkeypatch.setattr(handoff, "ENABLED", False)
    want = routed_experts_triton(x, logits, w13, w2, **route)
    assert not handoff._slots  # off: no chain, no slots
    monkeypatch.setattr(handoff, "ENABLED", True)
    programs = up_programs(top_k + append, w13)
    for step in range(3):  # the slots are reused: each step must find them as the first did
        got = routed_experts_triton(x, logits, w13, w2, **route)
        assert torch.equal(got, want), f"step {step}"
        (flags,) = handoff._slots.values()
        assert flags[0].item() == 0, f"step {step}: slot A left at {flags[0].item()} (the tail resets it)"
        assert flags[handoff.SLOT_INTS].item() == programs, \
            f"step {step}: slot B at {flags[handoff.SLOT_INTS].item()}, expected the {programs} gate|up programs"


def test_each_layer_has_its_own_slots(monkeypatch):
    monkeypatch.setattr(handoff, "ENABLED", True)
    x, logits, w13, w2 = case(8, 8, torch.float32, seed=1)
    _, _, w13b, w2b = case(8, 8, torch.float32, seed=2)
    for w in (w13, w13b):
        routed_experts_triton(x, logits, w, w2, top_k=2, renormalize=True)
    assert len(handoff._slots) == 2


def test_steps_of_several_tokens_take_no_chain(monkeypatch):
    """Two tokens: the aligned path (no chain: an aligned block past the padding returns before
    it could count), and no slots are made."""
    monkeypatch.setattr(handoff, "ENABLED", True)
    x, logits, w13, w2 = case(8, 8, torch.float32, seed=3, tokens=2)
    out = routed_experts_triton(x, logits, w13, w2, top_k=2, renormalize=True)
    assert out.shape == (2, H) and not handoff._slots


def test_a_chain_is_refused_where_it_cannot_hold():
    x, logits, w13, w2 = case(8, 8, torch.float32, seed=4, tokens=2)
    a, b = handoff.chain_flags(w13.data_ptr(), x.device)
    with pytest.raises(ValueError, match="one program"):
        softmax_topk_triton(logits, 2, True, flags=(a, b))
    ids = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    c = torch.empty(4, I, dtype=x.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="direct blocks"):
        moe_gemm(x, w13, c, None, None, ids, ids, ids, a_row_div=2, gated=True, block_m=16,
                 cfg=GemmConfig(32, 32, 4, 1), direct=False, flags=(FLAGS_MIDDLE, a, b, 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_chain_in_a_cuda_graph_replays_the_eager_bits(monkeypatch):
    monkeypatch.setattr(handoff, "ENABLED", True)
    x, logits, w13, w2 = case(64, 66, torch.bfloat16, seed=5)
    route = dict(top_k=6, renormalize=False, scale=1.0, append=2)
    want = routed_experts_triton(x, logits, w13, w2, **route)  # eager: the slots are made here
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        routed_experts_triton(x, logits, w13, w2, **route)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts_triton(x, logits, w13, w2, **route)
    for _ in range(50):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
