"""Speculative verify in the sampler: a row that verifies a proposed token outputs a token that
follows the target distribution exactly (accept the draft with probability p(d), else draw from p
without d), whatever the draft; a greedy row is the plain argmax. The engine-level distribution
test (a tiny model, speculation on vs off) is in test_spec_engine.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ketch.sampling.params import SamplingParams
from ketch.sampling.sampler import SamplingBatch, SamplingRow, sample
from test_sampling_distribution import CONFIGS, LOGITS8, _config_id, expected_probs

DRAWS = 20_000
TOL = 0.015  # the plain sampler's own distribution tests use this bound at 20k draws


def verify_freq(config: dict, drafts: list[int], seed0: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows i = 0..DRAWS-1 verify drafts[i % len] with seed seed0 + i: the output frequencies and,
    per draft token, how often it was the output (accepted or drawn)."""
    rows = [SamplingRow(SamplingParams(**config), seed=seed0 + i, draft=drafts[i % len(drafts)]) for i in range(DRAWS)]
    logits = torch.tensor([LOGITS8]).expand(DRAWS, 8).contiguous()
    tokens = np.array(sample(logits, SamplingBatch.build(rows, 8, "cpu")).token_ids)
    return np.bincount(tokens, minlength=8) / DRAWS, tokens


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_verified_rows_follow_the_target_distribution(config: dict) -> None:
    expected = expected_probs(**config)
    # drafts of every kind: the likeliest token, a rare one, one the filters remove
    freq, _ = verify_freq(config, [0, 3, 7], seed0=0)
    assert np.abs(freq - expected).max() < TOL, (freq.round(3), expected.round(3))
    assert np.all(freq[expected == 0] == 0)


def test_a_draft_is_accepted_with_its_target_probability() -> None:
    """All drafts 1: the output is 1 in p(1) of the rows (accepted); a broken accept test (say
    min(1, p/q) with q taken as uniform) would keep it far more often."""
    config = {"temperature": 0.7}
    p = expected_probs(**config)
    freq, _ = verify_freq(config, [1], seed0=7)
    assert abs(freq[1] - p[1]) < TOL
    assert np.abs(freq - p).max() < TOL


def test_greedy_rows_ignore_the_draft_and_take_the_argmax() -> None:
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=1, draft=d) for d in (0, 5, None)]
    logits = torch.tensor([LOGITS8] * 3)
    assert sample(logits, SamplingBatch.build(rows, 8, "cpu")).token_ids == [0, 0, 0]


def test_rows_without_a_draft_in_a_verify_batch_draw_as_without_speculation() -> None:
    """Drafted and undrafted rows share a batch: an undrafted row's token is exactly its plain draw."""
    config = SamplingParams(temperature=0.9, top_k=6)
    plain = [SamplingRow(config, seed=s) for s in range(64)]
    mixed = [SamplingRow(config, seed=s, draft=(s % 8) if s % 2 else None) for s in range(64)]
    logits = torch.tensor([LOGITS8] * 64)
    a = sample(logits, SamplingBatch.build(plain, 8, "cpu")).token_ids
    b = sample(logits, SamplingBatch.build(mixed, 8, "cpu")).token_ids
    assert [x for i, x in enumerate(a) if i % 2 == 0] == [x for i, x in enumerate(b) if i % 2 == 0]
    assert a != b  # the drafted rows did change (so the batch really verified)
