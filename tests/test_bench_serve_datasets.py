"""`ketch bench serve`: the prompt datasets (random lengths, ShareGPT parsing and filters)."""
from __future__ import annotations

import json

import pytest
from bench_util import tok  # noqa: F401  (a fixture)

from ketch.bench.datasets import random_requests, sharegpt_requests


def test_random_lengths_in_range_and_reproducible(tok):
    reqs = random_requests(tok, 30, 40, 20, 0.5, seed=7)
    assert all(20 <= r.prompt_len <= 40 for r in reqs)
    assert all(10 <= r.output_len <= 20 for r in reqs)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1  # actually spread, not pinned to one length
    assert random_requests(tok, 30, 40, 20, 0.5, seed=7) == reqs
    assert random_requests(tok, 30, 40, 20, 0.5, seed=8) != reqs
    fixed = random_requests(tok, 5, 33, 9, 1.0, seed=0)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(33, 9)] * 5
    with pytest.raises(ValueError, match="random_range_ratio"):
        random_requests(tok, 1, 8, 8, 1.5, seed=0)


def test_sharegpt_parsing_and_filters(tok, tmp_path):
    answer = "The capital of France is Paris, a city on the Seine."
    data = [
        {"conversations": [{"from": "human", "value": "What is the capital city of France, please?"},
                           {"from": "gpt", "value": answer}, {"from": "human", "value": "ignored"}]},
        {"conversations": [{"from": "gpt", "value": "a greeting that is not a prompt"},
                           {"from": "human", "value": "Tell me three facts about the planet Mars."},
                           {"from": "gpt", "value": "It is red, it is cold, and it has two moons."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": answer}]},  # prompt too short
        {"conversations": [{"from": "human", "value": "word " * 1100}, {"from": "gpt", "value": answer}]},  # too long
        {"conversations": [{"from": "human", "value": "A question without any answer at all?"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), tok, 10, seed=0)
    assert sorted(r.prompt for r in reqs) == ["Tell me three facts about the planet Mars.",
                                              "What is the capital city of France, please?"]
    paris = next(r for r in reqs if "France" in r.prompt)
    assert paris.output_len == len(tok.encode(answer, add_special_tokens=False))
    assert paris.prompt_len == len(tok.encode(paris.prompt, add_special_tokens=False))
    assert sharegpt_requests(str(path), tok, 10, seed=0) == reqs
    assert len(sharegpt_requests(str(path), tok, 1, seed=0)) == 1
    assert {r.output_len for r in sharegpt_requests(str(path), tok, 10, seed=0, output_len=12)} == {12}
    with pytest.raises(ValueError, match="dataset_path"):
        sharegpt_requests(str(tmp_path / "missing.json"), tok, 10, seed=0)
