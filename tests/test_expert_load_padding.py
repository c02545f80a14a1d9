"""The per-expert load of an MoE model (/metrics, EPLB's planner) counts the traffic only: a
decode step run on a padded graph batch (3 rows in the graph of 4) routes its padding rows too,
and a graph's warm-up forwards route whatever the static buffers hold. On the GPU both went into
the counters (an H100 engine test counted 6,444 picks for 288 routed); the runner now tells
ExpertLoad how many leading rows count (count_rows), and the routing kernel's atomics or the
counting hook leave the rest out.

Off CUDA the GraphRunner runs the same static-buffer forward eagerly (padding included), so the
CPU shows the padded count; the routing kernel runs in Triton's interpreter."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import greedy_ids_and_logprobs, make_tiny_engine
from ketch.runner.graph_runner import GraphRunner

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROMPTS = [[5, 9, 11], list(range(3, 20)), [7] * 9]  # 3 decode rows: the graph of 4, one padded row


def cut_qwen3_moe(tmp_path: Path) -> str:
    d = json.loads((CONFIGS / "qwen3-30b-a3b" / "config.json").read_text())
    d.update(num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, num_experts=8)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


def routed_load(path: str, kernels: str, padded: bool) -> tuple[list[list[int]], list[list[int]]]:
    engine = make_tiny_engine(path, layer_kernels=kernels)
    r = engine.runner
    calls: list[int] = []
    if padded:
        r.graphs = GraphRunner(r.model, r.attn, max_bs=8, max_model_len=engine.max_model_len, device=r.device,
                               future=r.future)
        run = r.graphs.run
        r.graphs.run = lambda batch: calls.append(batch.num_seqs) or run(batch)
    ids, _ = greedy_ids_and_logprobs(engine, PROMPTS, 5)
    assert (3 in calls) == padded  # the padded runs' decode steps went through the static buffers
    return ids, r.expert_load.totals()


@pytest.mark.parametrize("kernels", ["torch", "triton"])  # the counting hook; the routing kernel's atomics
def test_a_padded_graph_step_counts_only_its_real_rows(kernels, tmp_path):
    path = cut_qwen3_moe(tmp_path)
    want_ids, want = routed_load(path, kernels, padded=False)
    got_ids, got = routed_load(path, kernels, padded=True)
    assert got_ids == want_ids
    assert sum(map(sum, want)) > 0 and got == want


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_count_rows_zero_counts_nothing_and_none_counts_again(kernels, tmp_path):
    """What a graph's warm-ups run under (count_rows(0)), and the eager steps after them."""
    engine = make_tiny_engine(cut_qwen3_moe(tmp_path), layer_kernels=kernels)
    load = engine.runner.expert_load
    layer = next(m for m in engine.runner.model.modules() if hasattr(m, "count_rows") and hasattr(m, "select"))
    weight = next(layer.parameters())  # the engine's device and dtype (a CUDA engine on the GPU)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    load.count_rows(0)
    layer(x)
    assert sum(map(sum, load.totals())) == 0
    load.count_rows(2)
    layer(x)
    assert sum(map(sum, load.totals())) == 2 * 8  # Qwen3-30B-A3B routes 8 picks a token
    load.count_rows(None)
    layer(x)
    assert sum(map(sum, load.totals())) == 5 * 8

