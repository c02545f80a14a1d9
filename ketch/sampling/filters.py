"""Truncation filters (top-k, top-p, min-p) and the draw, batched over sampled rows.

Per-row parameters arrive as [S, 1] tensors with neutral values for rows that do not use a
filter (top_k = V, top_p = TOP_P_OFF, min_p = 0), so one kernel serves the whole sub-batch.
"""
from __future__ import annotations

import torch

# Above any cumulative probability: fp rounding in cumsum (which can reach 1.0 before the last
# token) must never trim a row that asked for top_p = 1.
TOP_P_OFF = 2.0


def top_k_only_(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept too).

    topk(max_k) is much cheaper than a full sort of a large vocabulary; max_k is known on the
    host when the batch is built, so there is no sync here.
    """
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
    kth = top_values.gather(1, (top_k - 1).clamp_(max=max_k - 1))
    return logits.masked_fill_(logits < kth, float("-inf"))


def top_k_top_p_(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor, max_k: int
) -> torch.Tensor:
    """Top-k then nucleus (top-p) over one descending ordering of the candidates.

    When every row has a top-k (max_k < V) only the max_k best tokens are candidates, and
    topk(max_k) replaces a full sort of the vocabulary (the expensive part on a GPU).
    Nucleus keeps the smallest prefix whose mass reaches top_p: token i (in sorted order)
    stays while the mass strictly before it is < top_p, so the first token always stays.
    """
    vocab = logits.shape[-1]
    if max_k < vocab:
        sorted_logits, order = logits.topk(max_k, dim=-1)  # sorted descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    remove: torch.Tensor | None = None
    if top_k is not None:
        ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
        remove = ranks >= top_k  # [S, candidates]
        sorted_logits.masked_fill_(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    remove_p = mass_before >= top_p
    remove_p[:, 0] = False  # the best token, whatever top_p is (one below float32's range is 0 here)
    remove = remove_p if remove is None else remove_p.logical_or_(remove)
    # Back to vocabulary order: position order[i, j] gets the verdict of candidate j; tokens
    # that were never candidates stay removed.
    if max_k < vocab:
        mask = torch.ones_like(logits, dtype=torch.bool)
    else:
        mask = torch.empty_like(logits, dtype=torch.bool)
    mask.scatter_(1, order, remove)
    return logits.masked_fill_(mask, float("-inf"))


def min_p_(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p times the row's top probability.

    No renormalisation: the draw below is invariant to the scale of each row.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return probs.masked_fill_(probs < threshold, 0.0)


def draw_(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from (unnormalised) probs, by inverting each row's CDF at its
    own uniform number `uniform` ([S, 1] float64 in (0, 1)).

    One number per row instead of V (an exponential race draws a [V] noise row per token): the
    draw is a pure function of the row's (seed, output index), which a stream resumed elsewhere
    can reproduce (counter_rng.py). The CDF is summed in float64 so that rare tokens keep their
    odds (float32 running sums would round a 1e-7 token's share to nothing or double it).

    A token of probability 0 (filtered, banned, masked) has cdf[j] == cdf[j - 1] and is never the
    first entry above the target, given a monotone CDF; a parallel scan may break monotonicity by
    a rounding, and a target at the very top of the CDF lands past the end: in those cases (about
    one draw in 2**50) the row takes its most likely token instead, never a forbidden one.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniform * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    allowed = probs.gather(1, picked) > 0
    return torch.where(allowed, picked, probs.argmax(dim=-1, keepdim=True)).squeeze(1)
