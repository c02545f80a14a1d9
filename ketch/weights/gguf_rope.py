"""RoPE scaling of a GGUF model, back into the `RopeScaling` that config.json would have said.

llama.cpp writes Llama-3.1-style scaling not as metadata but as a `rope_freqs.weight` tensor of
per-frequency divisors. We recover the parameters and accept them only if recomputing the divisors
from them reproduces the tensor, so an unfamiliar scheme fails loudly instead of running wrong.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ketch.config import RopeScaling


def llama3_divisors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The divisor applied to each rotary frequency under Llama-3 scaling (1 = unchanged)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, scaling.factor, mid))


def rope_scaling_from_gguf(
    meta: dict[str, Any], arch: str, rope_freqs: np.ndarray | None, head_dim: int, theta: float
) -> RopeScaling | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear", 1.0)))
    if kind not in ("none", "") and factor != 1.0:
        raise ValueError(f"model: GGUF rope scaling {kind!r} (factor {factor}) is not supported")
    if rope_freqs is None:
        return None
    divisors = rope_freqs.astype(np.float64).reshape(-1)
    orig = int(meta.get(f"{arch}.rope.scaling.original_context_length", 8192))
    guess = RopeScaling("llama3", float(divisors.max()), 1.0, 4.0, orig)
    if divisors.shape != (head_dim // 2,) or not np.allclose(
        divisors, llama3_divisors(guess, head_dim, theta), rtol=1e-4
    ):
        raise ValueError("model: GGUF rope_freqs tensor does not match Llama-3 rope scaling; unsupported")
    return guess
