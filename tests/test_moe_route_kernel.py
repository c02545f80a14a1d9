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
