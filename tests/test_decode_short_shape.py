"""The decode short shape (attention/triton_backend.py SHORT_SPAN) through the engine: a lone
request whose context grows past the short span decodes through the decode graphs' static buffers
(run eagerly off CUDA, as tests/test_decode_graph_inputs.py does), first in the size-1 graph of
the short shape, then in the long one; its tokens are the torch path's, and the graphed steps
compute what the eager Triton steps compute. A config of configs/ cut small (tests/engine_cut.py):
GQA (Llama) and MLA (DeepSeek-V2-Lite, whose short tile is 16 latent rows, not 32)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from conftest import greedy_ids_and_logprobs, make_tiny_engine
from engine_cut import cut_config

from ketch.attention import triton_backend
from ketch.runner.graph_runner import GraphRunner

SPAN = 10  # the short span here (the default's 256 would take minutes in the interpreter)
PROMPT = [5, 9, 11, 40, 2, 17, 23]  # 7 tokens: 3 decode steps fit the span, the last 5 do not
MAX_TOKENS = 9


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path (tests/test_gpu.py covers graphs on CUDA)")
@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v2-lite"])
def test_a_request_growing_past_the_short_span_changes_graphs_and_keeps_its_tokens(name, tmp_path, monkeypatch):
    monkeypatch.setattr(triton_backend, "SHORT_SPAN", SPAN)  # read when a backend is built
    path = cut_config(name, tmp_path)
    reference = make_tiny_engine(path, device="cpu", attention_backend="torch", layer_kernels="torch")
    want = greedy_ids_and_logprobs(reference, [PROMPT], MAX_TOKENS)
    eager = make_tiny_engine(path, device="cpu", attention_backend="triton", layer_kernels="triton")
    eager_out = greedy_ids_and_logprobs(eager, [PROMPT], MAX_TOKENS)

    engine = make_tiny_engine(path, device="cpu", attention_backend="triton", layer_kernels="triton")
    r = engine.runner
    r.graphs = GraphRunner(r.model, r.attn, max_bs=4, max_model_len=engine.max_model_len, device=r.device,
                           future=r.future)
    short, long = r.attn.decode_shape(1, SPAN), r.attn.decode_shape(1, engine.max_model_len)
    assert short != long and short[1] == (16 if name.startswith("deepseek") else 64)
    keys: list = []
    run = r.graphs.run
    r.graphs.run = lambda batch: keys.append(r.attn.graph_key(batch, r.graphs.size_for(batch.num_seqs))) or run(batch)
    got = greedy_ids_and_logprobs(engine, [PROMPT], MAX_TOKENS)
    engine.check_invariants()

    # the prefill makes the first token; decode step i (from 1) holds len(PROMPT) + i tokens
    fit = SPAN - len(PROMPT)
    assert keys == [(1, *short)] * fit + [(1, *long)] * (MAX_TOKENS - 1 - fit), keys
    assert got[0] == want[0] == eager_out[0]
    assert max(abs(a - b) for a, b in zip(got[1][0], want[1][0], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(got[1][0], eager_out[1][0], strict=True)) < 1e-6
