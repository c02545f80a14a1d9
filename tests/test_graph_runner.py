"""One graph runner for every attention backend (runner/graph_runner.py), checked on the CPU.

A new backend needs no new runner: `StagedTorchBackend` below is a backend the runner has never
seen (the torch reference's attention, with graph hooks of its own design: graphs keyed by the
batch size only, one int64 stage buffer carrying ids, positions, slots, lengths and the full-
width page table in one host→device copy, padded rows copying row 0). Off CUDA the runner runs
the static-buffer forward eagerly through those hooks; it must give the eager step's tokens and
leave the KV pool holding exactly what the eager engine's does (padding wrote nowhere else).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import greedy_ids_and_logprobs, make_tiny_engine
from ketch.attention.base import AttentionBackend, GraphInputs, GraphKey
from ketch.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from ketch.forward_batch import ForwardBatch
from ketch.host_copy import to_device
from ketch.runner.graph_runner import GraphRunner, capture_sizes

PROMPTS = [[5, 9, 11], list(range(3, 40)), [7] * 9]  # 3 rows (padded to 4), 1 to 10 pages of 4


class StagedTorchBackend(TorchAttentionBackend):
    """Test-local: the torch backend's attention with a different static-buffer design."""

    def init_capture(self, sizes: list[int], max_model_len: int) -> list[GraphKey]:
        self.max_bs, self.max_pages = max(sizes), -(-max_model_len // self.page_size)
        self.stage = torch.zeros(4 * self.max_bs + self.max_bs * self.max_pages, dtype=torch.long, device=self.device)
        return []  # captured on first use

    def graph_key(self, batch: ForwardBatch, bs: int) -> GraphKey | None:
        return (bs,)  # one width for every step: the whole page table

    def capture_inputs(self, key: GraphKey) -> GraphInputs:
        (bs,) = key
        s, width = self.stage, self.max_pages * self.page_size
        table = s[4 * bs : 4 * bs + bs * self.max_pages].view(bs, self.max_pages)
        visible = torch.arange(width, device=self.device)[None, :] < s[3 * bs : 4 * bs, None]
        meta = TorchAttentionMetadata(slots=s[2 * bs : 3 * bs], num_decode=bs, decode_pages=table,
                                      decode_mask=self._additive(visible)[:, None, None, :], prefills=[])
        return GraphInputs(s[:bs], s[bs : 2 * bs], meta)

    def prepare_replay(self, batch: ForwardBatch, key: GraphKey) -> None:
        (bs,), n = key, batch.num_seqs
        host = np.zeros(4 * bs + bs * self.max_pages, np.int64)  # columns past a row's pages: page 0, masked
        vec = host[: 4 * bs].reshape(4, bs)
        vec[:, :n] = batch.input_ids, batch.positions, batch.slots, batch.kv_lens
        vec[:, n:] = vec[:, :1]  # padded rows copy row 0: the same K/V into row 0's own slot
        table = host[4 * bs :].reshape(bs, self.max_pages)
        table[:n, : batch.page_table.shape[1]] = batch.page_table
        table[n:] = table[0]
        self.stage[: host.size].copy_(to_device(host, self.device))


def test_capture_sizes_are_powers_of_two_then_the_cap():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(256)[-3:] == [64, 128, 256]


class NoHooks(AttentionBackend):
    def init_metadata(self, batch: ForwardBatch) -> None:
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: None) -> torch.Tensor:
        raise AssertionError("never called: the runner refuses the backend first")


def test_a_backend_without_graph_hooks_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="NoHooks has no decode-graph hooks"):
        GraphRunner(torch.nn.Identity(), NoHooks(), max_bs=4, max_model_len=64, device=torch.device("cpu"))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_new_backend_runs_through_the_one_graph_runner(tiny_config_path, overlap):
    eager = make_tiny_engine(tiny_config_path)
    want_ids, want_lp = greedy_ids_and_logprobs(eager, PROMPTS, max_tokens=6)
    engine = make_tiny_engine(tiny_config_path, overlap_schedule=overlap)
    r = engine.runner
    r.attn = StagedTorchBackend(r.pool, r.model_config.head_dim, r.device)  # eager steps use it too
    r.graphs = GraphRunner(r.model, r.attn, max_bs=8, max_model_len=engine.max_model_len, device=r.device,
                           future=r.future)
    keys = []
    run = r.graphs.run
    r.graphs.run = lambda batch: keys.append(r.attn.graph_key(batch, r.graphs.size_for(len(batch)))) or run(batch)
    got_ids, got_lp = greedy_ids_and_logprobs(engine, PROMPTS, max_tokens=6)
    assert (4,) in keys  # decode steps went through the runner, 3 rows padded to 4
    assert got_ids == want_ids
    for a, b in zip(got_lp, want_lp, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    for layer in range(len(r.pool.k)):  # padded rows wrote row 0's own K/V, nothing else
        torch.testing.assert_close(r.pool.k[layer], eager.runner.pool.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r.pool.v[layer], eager.runner.pool.v[layer], atol=1e-5, rtol=1e-5)
    engine.check_invariants()
