"""YaRN rotary scaling (DeepSeek-V2/V3's `rope_scaling` of type "yarn") and the rotary tables of
a decoupled RoPE part, as HF transformers computes them (modeling_rope_utils, deepseek_v2/v3).

Three numbers come out of a YaRN config, and a model needs all three:

    inverse_frequencies(dim, theta)   interpolated frequencies below the `beta_slow` rotation
                                      count, the original ones above `beta_fast`, a linear
                                      ramp between (dims floored/ceiled when `truncate`)
    rope_factor                       multiplies cos and sin, so q_pe and k_pe each carry it
                                      (the stored k_pe included): `attention_factor` if given,
                                      else mscale(factor, mscale) / mscale(factor, mscale_all_dim)
                                      when both are set, else mscale(factor, 1)
    softmax_factor                    multiplies the softmax scale of every score (nope and
                                      rope part): mscale(factor, mscale_all_dim)**2 when
                                      mscale_all_dim is set, else 1

with mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1. DeepSeek's released configs set
mscale == mscale_all_dim (0.707), so rope_factor is 1 and the whole correction is in the
softmax scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ketch.layers.rope_tables import RopeTables


def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def rope_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        return mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inverse_frequencies(self, dim: int, theta: float) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            wavelengths = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(wavelengths) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
        return (1.0 / (self.factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate


class ScaledRotary(RopeTables):
    """cos/sin tables of a `dim`-wide rotary part (rotate-half layout, like layers/rotary.py),
    multiplied by `factor`; plain RoPE when `yarn` is None."""

    def __init__(self, dim: int, max_positions: int, theta: float, yarn: YarnScaling | None) -> None:
        if yarn is None:
            inv_freq, factor = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        else:
            inv_freq, factor = yarn.inverse_frequencies(dim, theta), yarn.rope_factor
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * factor, freqs.sin() * factor
        super().__init__(torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))  # [positions, dim], fp32
