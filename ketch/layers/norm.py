"""RMSNorm: statistics in fp32 whatever the activation dtype (SmolLM2's residual stream reaches
~25,000, where a bf16 mean of squares is far off), then the weight in the activation dtype —
the reference formula, bit for bit in fp32."""
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
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight
