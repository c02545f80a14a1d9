"""Sampling: the empirical distribution of seeded draws equals the filtered softmax (temperature,
top-k, top-p, min-p; one config per batch and a mixed batch). Split from test_sampling.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_sampling import run, seeded_row

LOGITS8 = [2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.0]


def expected_probs(temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0):
    """Reference in float64: temperature, top-k, nucleus, min-p, renormalize."""
    z = np.array(LOGITS8, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    mass_before = np.cumsum(p[order]) - p[order]
    # Keep the test away from ties at the nucleus boundary.
    assert np.all(np.abs(mass_before - top_p) > 0.02) or top_p == 1.0
    keep_p = np.zeros_like(keep)
    keep_p[order[mass_before < top_p]] = True
    p = np.where(keep_p, p, 0.0)
    p = np.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


CONFIGS = [
    {"temperature": 0.7},
    {"temperature": 0.7, "top_p": 0.88},  # keeps 4 tokens
    {"temperature": 0.7, "top_k": 2},
    {"temperature": 0.7, "min_p": 0.25},  # keeps 3 tokens
    {"temperature": 1.3, "top_k": 5, "top_p": 0.8, "min_p": 0.45},
]


def empirical(
    device: str, configs: list[dict], draws: int, seed0: int
) -> list[np.ndarray]:
    """Row i draws with seed seed0 + i (its first token): a fixed sample for CI."""
    rows = [
        seeded_row(seed0 + i, device, **configs[i % len(configs)])
        for i in range(draws * len(configs))
    ]
    logits = torch.tensor([LOGITS8], device=device).expand(len(rows), 8).contiguous()
    tokens = np.array(run(logits, rows).token_ids).reshape(draws, len(configs))
    return [np.bincount(tokens[:, j], minlength=8) / draws for j in range(len(configs))]


def _config_id(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_sampling_distribution(config: dict) -> None:
    # One config per batch (the fast paths).
    (freq,) = empirical("cpu", [config], 20_000, seed0=0)
    expected = expected_probs(**config)
    assert np.abs(freq - expected).max() < 0.015, (freq.round(3), expected.round(3))
    assert np.all(freq[expected == 0] == 0)


def test_sampling_distribution_mixed_batch() -> None:
    # Every config in one batch, seeded rows: per-row knobs must not leak between rows.
    for config, freq in zip(CONFIGS, empirical("cpu", CONFIGS, 20_000, seed0=10**6), strict=True):
        expected = expected_probs(**config)
        assert np.abs(freq - expected).max() < 0.015, (config, freq.round(3), expected.round(3))
        assert np.all(freq[expected == 0] == 0)
