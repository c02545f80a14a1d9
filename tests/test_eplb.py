"""EPLB's planner (ketch/layers/eplb.py, DeepSeek's algorithm) as a pure function: DeepSeek's own
published example, then invariants on random loads (every logical expert has a replica, slot
counts add up, the maps agree, groups stay on one node, GPUs end up balanced)."""
from __future__ import annotations

import pytest
import torch

from ketch.layers.eplb import balanced_packing, rebalance_experts, replicate_experts


def test_deepseek_readme_example():
    """The example in deepseek-ai/EPLB's README: 2 layers, 12 experts in 4 groups, 16 replicas,
    2 nodes of 4 GPUs (hierarchical)."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, _, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, gpus: int) -> torch.Tensor:
    """[layers, gpus]: each slot carries its expert's load / its replica count."""
    per_slot = (weight.float() / logcnt).gather(1, phy2log)
    return per_slot.view(weight.shape[0], gpus, -1).sum(-1)


CASES = [  # experts, replicas, groups, nodes, gpus
    (8, 8, 1, 1, 2), (8, 10, 1, 1, 2), (16, 20, 4, 2, 4), (16, 24, 8, 2, 8), (12, 16, 3, 2, 4), (64, 72, 8, 1, 8),
]


@pytest.mark.parametrize("experts,replicas,groups,nodes,gpus", CASES)
def test_plans_are_complete_and_balanced(experts, replicas, groups, nodes, gpus):
    weight = torch.randint(0, 1000, (3, experts), generator=torch.Generator().manual_seed(experts + replicas)) ** 2
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    assert phy2log.shape == (3, replicas) and logcnt.shape == (3, experts)
    assert (logcnt >= 1).all() and (logcnt.sum(1) == replicas).all()
    for layer in range(3):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=experts), logcnt[layer])
        for e in range(experts):
            slots = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert slots.numel() == logcnt[layer, e] and (phy2log[layer, slots] == e).all()
    if groups % nodes == 0 and nodes > 1:  # hierarchical: an expert group lives on one node
        group_of = phy2log // (experts // groups)
        for node in group_of.view(3, nodes, -1).unbind(1):
            for layer in range(3):
                for g in node[layer].unique():
                    assert ((group_of[layer] == g).view(nodes, -1).any(1)).sum() == 1
    loads = gpu_loads(weight, phy2log, logcnt, gpus)
    naive = weight.float().view(3, gpus, -1).sum(-1) if replicas == experts else None
    assert (loads.max(1).values <= 1.35 * loads.mean(1)).all(), loads
    if naive is not None:
        assert (loads.max(1).values <= naive.max(1).values).all()


def test_replication_goes_to_the_hottest_expert_per_replica():
    phy2log, rank, logcnt = replicate_experts(torch.tensor([[10.0, 100.0, 30.0, 45.0]]), 7)
    assert phy2log.tolist() == [[0, 1, 2, 3, 1, 1, 3]]  # 100 (1) -> 50 (1 again) -> 45 (3)
    assert logcnt.tolist() == [[1, 3, 1, 2]] and rank[0, 4:].tolist() == [1, 2, 1]


def test_balanced_packing_fills_every_pack_equally():
    pack, rank = balanced_packing(torch.tensor([[9.0, 1, 8, 2, 7, 3]]), 3)
    assert torch.bincount(pack[0]).tolist() == [2, 2, 2]
    loads = torch.zeros(3).index_add_(0, pack[0], torch.tensor([9.0, 1, 8, 2, 7, 3]))
    assert loads.tolist() == [10.0, 10.0, 10.0]
    assert sorted(zip(pack[0].tolist(), rank[0].tolist())) == [(p, r) for p in range(3) for r in range(2)]


def test_placements_that_do_not_divide_fail():
    with pytest.raises(ValueError):
        rebalance_experts(torch.ones(1, 8), 9, 1, 1, 2)
    with pytest.raises(ValueError):
        replicate_experts(torch.ones(1, 8), 7)
