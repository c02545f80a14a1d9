"""EPLB's planner: DeepSeek's published expert-parallel load balancer (deepseek-ai/EPLB,
eplb.py), a pure function of the measured load.

    rebalance_experts(weight [layers, logical], num_replicas, num_groups, num_nodes, num_gpus)
        -> phy2log [layers, num_replicas]        the logical expert in each physical slot
           log2phy [layers, logical, max_cnt]    each logical expert's slots (-1 padded)
           logcnt  [layers, logical]             how many slots each logical expert has

Slot p lives on GPU p // (num_replicas / num_gpus). Two policies, as DeepSeek's:
  * hierarchical (num_groups % num_nodes == 0: expert groups, e.g. DeepSeek V3's n_group, never
    straddle nodes): pack the groups onto nodes balancing the nodes' load, replicate the hottest
    experts within each node (num_replicas / num_nodes slots per node), then pack each node's
    physical experts onto its GPUs;
  * global (otherwise): the same with one group and one node: replicate over all slots, pack over
    all GPUs.
`replicate_experts` gives each extra slot to the expert with the largest load per replica;
`balanced_packing` puts items heaviest first into the lightest pack that still has room (every
pack gets the same number of items).
"""
from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [layers, items] -> (pack of each item, its index inside the pack), each pack
    holding items / num_packs of them, heaviest first into the lightest pack with room."""
    num_layers, num_items = weight.shape
    if num_items % num_packs:
        raise ValueError(f"{num_items} items do not pack evenly into {num_packs} packs")
    per_pack = num_items // num_packs
    if per_pack == 1:
        index = torch.arange(num_items, dtype=torch.int64).expand(num_layers, -1).clone()
        return index, torch.zeros_like(index)
    order = weight.float().sort(-1, descending=True).indices
    pack_index = torch.full((num_layers, num_items), -1, dtype=torch.int64)
    rank_in_pack = torch.full_like(pack_index, -1)
    for layer in range(num_layers):
        loads, items = [0.0] * num_packs, [0] * num_packs
        for item in order[layer].tolist():
            pack = min((p for p in range(num_packs) if items[p] < per_pack), key=loads.__getitem__)
            pack_index[layer, item] = pack
            rank_in_pack[layer, item] = items[pack]
            loads[pack] += float(weight[layer, item])
            items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [layers, logical] -> (phy2log [layers, num_phy], replica rank of each slot, logcnt):
    slots 0..logical-1 hold each expert once; each extra slot replicates the expert whose load
    per replica is the largest at that point."""
    num_layers, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy} physical slots cannot hold {num_log} experts")
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_layers, 1)
    rank = torch.zeros(num_layers, num_phy, dtype=torch.int64)
    logcnt = torch.ones(num_layers, num_log, dtype=torch.int64)
    layers = torch.arange(num_layers)
    for slot in range(num_log, num_phy):
        hottest = (weight / logcnt).max(dim=-1).indices
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[layers, hottest]
        logcnt[layers, hottest] += 1
    return phy2log, rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.size(1), dtype=torch.int64).expand(perm.shape))
    return inv


def rebalance_hierarchical(weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int,
                           num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, replica rank of each slot, logcnt); see the module docstring."""
    num_layers, num_log = weight.shape
    if num_log % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_phy % num_gpus:
        raise ValueError(f"{num_log} experts in {num_groups} groups, {num_phy} slots, {num_nodes} nodes "
                         f"and {num_gpus} GPUs do not divide evenly")
    group_size, groups_per_node = num_log // num_groups, num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1: groups onto nodes; "mlog" numbers the logical experts node by node
    group_load = weight.unflatten(-1, (num_groups, group_size)).sum(-1)
    group_pack, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size).unsqueeze(-1)
                + torch.arange(group_size, dtype=torch.int64)).flatten(-2)
    mlog2log = _inverse(log2mlog)
    # 2: replicas within each node (each node's experts are a row of their own)
    mlog_load = weight.gather(-1, mlog2log).view(-1, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)
    # 3: each node's physical experts onto its GPUs
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in_pack = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * per_gpu + rank_in_pack)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    node_base = torch.arange(0, num_log, num_log // num_nodes, dtype=torch.int64).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(num_layers, num_nodes, -1) + node_base).flatten(-2)
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(num_layers, -1)
    logcnt = mlogcnt.view(num_layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(phy2log, log2phy, logcnt) of a placement of `num_replicas` physical experts on `num_gpus`
    GPUs in `num_nodes` nodes balancing `weight` (each logical expert's load, e.g. its tokens)."""
    num_layers, num_log = weight.shape
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    most = int(logcnt.max())
    log2phy = torch.full((num_layers, num_log, most), -1, dtype=torch.int64)
    log2phy.view(num_layers, -1).scatter_(-1, phy2log * most + phyrank,
                                          torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1))
    return phy2log, log2phy, logcnt
