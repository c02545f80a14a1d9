"""RMSNorm: normalize (torch's fused kernel accumulates in fp32 for bf16 inputs), round to the
activation dtype, then multiply by the weight — the reference formula, bit for bit in fp32.
Passing the weight into the fused kernel instead multiplies before rounding, which on bf16
SmolLM2 (residual stream up to ~25,000) derails generation within a few tokens."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, None, self.eps) * self.weight
