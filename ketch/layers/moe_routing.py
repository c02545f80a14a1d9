"""Routing of a sparse mixture of experts: router logits [tokens, experts] -> (weights, ids), each
[tokens, top_k]; weights fp32, ids int64. The order of the k picks is not part of the contract
(the combine sums over them).

    softmax_topk(logits, top_k, renormalize)     Mixtral (renormalize always), Qwen2/3-MoE
                                                 (`norm_topk_prob`): softmax over all experts, the
                                                 k largest, optionally rescaled to sum to 1
    grouped_topk(logits, top_k, n_group=, topk_group=, scoring=, correction_bias=,
                 renormalize=, routed_scaling_factor=)
                                                 DeepSeek V2 / V3: experts in `n_group` equal
                                                 groups, only the best `topk_group` groups may be
                                                 picked from; then the k best experts of those

DeepSeek's grouped routing, as its configs name it:
  * `scoring_func` "softmax" (V2) or "sigmoid" (V3) turns logits into scores (in fp32);
  * `topk_method` "greedy": n_group = topk_group = 1 (every expert is in the one group);
    "group_limited_greedy" (V2): a group's score is its best expert's score;
    "noaux_tc" (V3): `e_score_correction_bias` is added to the scores for the *choice* only
    (groups and experts), a group's score is the sum of its two best biased scores; the weights
    are the unbiased scores of the chosen experts;
  * `norm_topk_prob`: the k weights divided by their sum (+1e-20), then
  * `routed_scaling_factor` multiplies them.

    append_picks(weights, ids, first, count)     `count` always-picked slots after the k:
                                                 ids first, first + 1, ... at weight 1
                                                 (DeepSeek's shared experts as experts of the
                                                 fused MoE, ketch/models/deepseek_moe.py)
"""
from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (fp32), the k largest probabilities; `renormalize`: divided by
    their sum (Mixtral always; Qwen-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _group_scores(choice: torch.Tensor, n_group: int, by_top2_sum: bool) -> torch.Tensor:
    """[tokens, n_group]: each group's best score, or the sum of its best two (noaux_tc)."""
    grouped = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group)  # (not -1: 0 tokens)
    if by_top2_sum:
        return grouped.topk(2, dim=-1).values.sum(dim=-1)
    return grouped.max(dim=-1).values


def grouped_topk(logits: torch.Tensor, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                 scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                 renormalize: bool = False, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek routing. `correction_bias` given: noaux_tc (V3: groups by their two best biased
    scores); None: group_limited_greedy (V2: groups by their best score; greedy when n_group is 1).
    Groups outside the best `topk_group` are masked out before the expert top-k."""
    experts = logits.shape[-1]
    if experts % n_group:
        raise ValueError(f"n_group: {experts} experts do not split into {n_group} groups")
    if scoring == "softmax":
        scores = torch.softmax(logits.float(), dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits.float())
    else:
        raise ValueError(f"scoring_func: unsupported {scoring!r} (softmax, sigmoid)")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        groups = _group_scores(choice, n_group, by_top2_sum=correction_bias is not None)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
        keep = keep.repeat_interleave(experts // n_group, dim=1)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def append_picks(weights: torch.Tensor, ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) [T, k] -> [T, k + count]: slots k.. pick experts first, first + 1, ... at
    weight 1 for every token (count 0: unchanged)."""
    if not count:
        return weights, ids
    extra = torch.arange(first, first + count, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], count)
    return torch.cat((weights, weights.new_ones(weights.shape[0], count)), 1), torch.cat((ids, extra), 1)
