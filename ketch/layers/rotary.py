"""Rotary position embedding (NeoX / rotate-half layout) with optional Llama-3 frequency scaling.

cos/sin are tabulated once for every position up to the context length, so a step only
gathers rows by position instead of recomputing trigonometry.
"""
from __future__ import annotations

import math

import torch

from ketch.config import RopeScaling
from ketch.layers.rope_tables import RopeTables


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(RopeTables):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        # Full-width tables, sin signed for the rotate-half layout: out = x*cos + swap_halves(x)*sin
        super().__init__(torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))  # [positions, head_dim], fp32


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]. Equals x1*c - x2*s | x2*c + x1*s, bit for bit."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return x * cos + swapped * sin
