"""`ketch bench serve`: the prompt datasets (random lengths, a mix of fixed lengths, ShareGPT parsing
and filters, groups sharing a generated system prompt)."""
from __future__ import annotations

import argparse
import json
import os

import pytest
from bench_util import tok  # noqa: F401  (a fixture)

from ketch.bench.datasets import (GSP_SEPARATOR, mixed_requests, random_requests, shared_prefix_requests,
                                  sharegpt_requests)
from ketch.bench.serve import build_requests
from ketch.bench.serve_args import add_bench_serve_args


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


def test_shared_prefix_groups_shapes_and_reproducibility(tok):
    reqs = shared_prefix_requests(tok, 4, 3, 48, 8, 5, seed=2)
    assert len(reqs) == 12 and sorted(r.group for r in reqs) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert {r.output_len for r in reqs} == {5}
    assert all(r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False)) for r in reqs)
    # a group's system prompt: what its prompts have in common, up to the separator (random text may hold
    # the separator's characters too, so the last one)
    common = {g: os.path.commonprefix([r.prompt for r in reqs if r.group == g]) for g in range(4)}
    system = {g: c[:c.rindex(GSP_SEPARATOR)] for g, c in common.items()}
    assert len(set(system.values())) == 4  # one system prompt per group
    for g, text in system.items():
        assert len(tok.encode(text, add_special_tokens=False)) == 48
        prefix_ids = tok.encode(text + GSP_SEPARATOR, add_special_tokens=False)
        group = [r for r in reqs if r.group == g]
        assert len({r.prompt for r in group}) == 3  # each request its own question
        for r in group:
            assert r.prompt.startswith(text + GSP_SEPARATOR)
            question = r.prompt[len(text + GSP_SEPARATOR):]
            assert len(tok.encode(question, add_special_tokens=False)) == 8
            # the exact tokens a prefix cache keys on: the group's prefix, whatever follows it
            assert tok.encode(r.prompt, add_special_tokens=False)[:len(prefix_ids)] == prefix_ids
    # shuffled: the groups interleave rather than arriving one group after the other
    order = [r.group for r in reqs]
    assert order != sorted(order)
    assert shared_prefix_requests(tok, 4, 3, 48, 8, 5, seed=2) == reqs
    assert shared_prefix_requests(tok, 4, 3, 48, 8, 5, seed=3) != reqs
    with pytest.raises(ValueError, match="gsp_prompts_per_group"):
        shared_prefix_requests(tok, 4, 0, 48, 8, 5, seed=2)


def test_mixed_lengths_exact_shares_shuffled_and_reproducible(tok):
    reqs = mixed_requests(tok, 8, [64, 8], [1, 3], 16, 1.0, seed=3)
    assert sorted(r.prompt_len for r in reqs) == [8] * 6 + [64] * 2  # exact shares, not drawn
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len for r in reqs)
    assert [r.output_len for r in reqs] == [16] * 8
    assert [r.prompt_len for r in reqs] != [64, 64] + [8] * 6  # shuffled, not in blocks
    assert mixed_requests(tok, 8, [64, 8], [1, 3], 16, 1.0, seed=3) == reqs
    assert mixed_requests(tok, 8, [64, 8], [1, 3], 16, 1.0, seed=4) != reqs
    # largest remainder: 7 prompts in equal shares of three lengths is 3, 2, 2 (the order of the lengths breaks ties)
    assert sorted(r.prompt_len for r in mixed_requests(tok, 7, [12, 8, 4], [1, 1, 1], 4, 1.0, seed=0)) == \
        [4, 4, 8, 8, 12, 12, 12]
    with pytest.raises(ValueError, match="mixed_weights"):
        mixed_requests(tok, 4, [64, 8], [1], 16, 1.0, seed=0)
    with pytest.raises(ValueError, match="mixed_input_lens"):
        mixed_requests(tok, 4, [64, 0], [1, 1], 16, 1.0, seed=0)


def test_mixed_from_the_command_line_equal_shares_by_default(tok):
    p = argparse.ArgumentParser()
    add_bench_serve_args(p)
    a = p.parse_args(["--dataset-name", "mixed", "--mixed-input-lens", "40,8", "--num-prompts", "6",
                      "--random-output-len", "5", "--random-range-ratio", "1"])
    assert sorted(r.prompt_len for r in build_requests(a, tok)) == [8, 8, 8, 40, 40, 40]
    a = p.parse_args(["--dataset-name", "mixed", "--mixed-input-lens", "40,8", "--mixed-weights", "1,2",
                      "--num-prompts", "6"])
    assert sorted(r.prompt_len for r in build_requests(a, tok)) == [8, 8, 8, 8, 40, 40]
