"""The CUDA-graph decode path's static inputs over the torch backend (runner/graph_runner.py and
the torch backend's graph hooks), checked on the CPU.

Off CUDA, GraphRunner runs its static-buffer forward eagerly, so the parts a graph depends on
(batch and page buckets, padding rows copied from row 0, padded pages masked out) are tested
here against the ordinary eager step; tests/test_gpu.py checks the captured graphs on a GPU.
"""
from __future__ import annotations

import pytest

from conftest import greedy_ids_and_logprobs, make_tiny_engine
from ketch.runner.graph_runner import GraphRunner, bucket


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 100)] == [1, 2, 4, 4, 8, 16, 32, 128]


def _greedy(engine, prompts):
    return greedy_ids_and_logprobs(engine, prompts, max_tokens=12)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_static_buffer_decode_equals_the_eager_step(tiny_config_path, overlap):
    # 3 requests (padded to 4 rows) of different lengths: page buckets differ per row
    prompts = [[5, 9, 11], list(range(3, 20)), [7] * 9]
    eager = make_tiny_engine(tiny_config_path)
    want_ids, want_lp = _greedy(eager, prompts)
    # overlap: each decode row's input id is a placeholder, resolved inside the static forward
    padded = make_tiny_engine(tiny_config_path, overlap_schedule=overlap)
    r = padded.runner
    r.graphs = GraphRunner(r.model, r.attn, max_bs=8, max_model_len=padded.max_model_len, device=r.device,
                           future=r.future)
    calls = []
    run = r.graphs.run
    r.graphs.run = lambda chunks: calls.append(len(chunks)) or run(chunks)
    got_ids, got_lp = _greedy(padded, prompts)
    assert 3 in calls  # decode steps went through the static buffers with a padded row
    assert got_ids == want_ids
    for a, b in zip(got_lp, want_lp, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    padded.check_invariants()
