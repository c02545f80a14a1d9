"""`block` speculation's own parts: the confidence-scheduled verify (spec/verify_schedule.py) against
a brute-force optimum, the measured cost table, the draft head's weights file, the hidden state
the engine hands the head (the target's own at the row that produced the last token), and the
engine with the schedule on: lossless whatever lengths it picks. Lossless output with the head's
random weights under overlap, preemption, n > 1, stops, penalties and aborts, and the sampled
distribution, are in test_spec_engine.py (its `block` cases)."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import safetensors.torch
import torch

from conftest import TINY_LLAMA, assert_drained, collect, drain, make_tiny_engine
from ketch.runner.graph_runner import GraphRunner
from ketch.sampling.params import SamplingParams
from ketch.spec.cost_model import AlwaysSpeculate
from ketch.spec.block import BlockDraftHead
from ketch.spec.oracle import OracleProposer
from ketch.spec.proposer import DraftInput
from ketch.spec.verify_schedule import VerifyCost, verify_lengths
from test_spec_engine import BLOCK, GREEDY, prompts


class LinearCost(VerifyCost):
    """C(R) = a + b R, fixed (record ignores measurements: the schedule alone is under test)."""

    def __init__(self, a: float, b: float) -> None:
        super().__init__()
        self.a, self.b = a, b

    def record(self, rows: int, seconds: float) -> None:
        pass

    def __call__(self, rows: int) -> float:
        return self.a + self.b * rows


def expected_rate(conf: np.ndarray, lengths: tuple[int, ...], cost) -> float:
    reach = np.cumprod(conf, axis=1)
    tokens = sum(1 + reach[b, :n].sum() for b, n in enumerate(lengths))
    return tokens / cost(len(lengths) + sum(lengths))


@pytest.mark.parametrize("seed", range(40))
def test_schedule_is_the_brute_force_optimum_under_a_linear_cost(seed):
    rng = np.random.default_rng(seed)
    batch, k = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    conf = rng.beta(0.6, 0.6, size=(batch, k))  # many near 0 and near 1
    room = [int(rng.integers(0, k + 1)) for _ in range(batch)]
    cost = LinearCost(float(rng.uniform(0.2, 2.0)), float(rng.uniform(0.0, 0.5)))
    got = tuple(verify_lengths(conf, room, cost))
    best = max(expected_rate(conf, ls, cost) for ls in itertools.product(*(range(m + 1) for m in room)))
    assert all(0 <= n <= m for n, m in zip(got, room))
    assert expected_rate(conf, got, cost) >= best - 1e-9, (got, best)


def test_schedule_takes_everything_when_rows_are_free_and_nothing_unlikely_when_they_cost():
    conf = np.array([[0.9, 0.8, 0.1, 0.9], [0.01, 0.9, 0.9, 0.9]])
    assert verify_lengths(conf, [4, 4], VerifyCost()) == [4, 4]  # nothing measured: flat
    assert verify_lengths(conf, [2, 4], VerifyCost()) == [2, 4]
    assert verify_lengths(np.zeros((2, 4)), [4, 4], VerifyCost()) == [0, 0]
    assert verify_lengths(conf, [4, 4], LinearCost(0.0, 1.0)) == [0, 0]  # every row costs a full step
    assert verify_lengths(conf, [4, 4], LinearCost(1.0, 0.1)) == [2, 0]  # 0.9, 0.72 pay; 0.072 does not
    with pytest.raises(ValueError, match="max_draft"):
        verify_lengths(conf, [4], VerifyCost())


def test_verify_cost_averages_per_bucket_and_interpolates_between():
    c = VerifyCost()
    c.record(4, 0.010)
    c.record(3, 0.020)  # same bucket (4): an average moves toward it
    assert 0.010 < c(4) < 0.020
    c.record(16, 0.050)
    assert c(1) == c(4) and c(64) == c(16)  # flat outside what was measured
    assert c(4) < c(10) < c(16)
    c.record(0, 1.0)
    c.record(8, -1.0)  # nonsense is ignored
    assert set(c.seconds) == {4, 16}


def test_the_head_loads_its_weights_file_and_refuses_another_models(tmp_path, tiny_config_path):
    head = BlockDraftHead(TINY_LLAMA["hidden_size"], TINY_LLAMA["hidden_size"], 4)
    head.init_random(123)
    path = tmp_path / "head.safetensors"
    safetensors.torch.save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(path))
    eng = make_tiny_engine(tiny_config_path, speculative_draft_model_path=str(path), **BLOCK)
    loaded = eng.spec.proposer.head
    # compared on the host: on a GPU machine the engine's head lives on the GPU
    assert all(torch.equal(loaded.state_dict()[k].cpu(), v) for k, v in head.state_dict().items())
    random = make_tiny_engine(tiny_config_path, **BLOCK).spec.proposer.head  # seed 0: other weights
    assert not torch.equal(random.positions.cpu(), loaded.positions.cpu())
    wrong = tmp_path / "wrong.safetensors"
    other = BlockDraftHead(32, 32, 4)
    safetensors.torch.save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(wrong))
    with pytest.raises(ValueError, match="speculative_draft_model_path: .* is not a draft head for this model"):
        make_tiny_engine(tiny_config_path, speculative_draft_model_path=str(wrong), **BLOCK)


def block_engine(config_path: str, decode: str):
    """A `block` engine whose decode steps run eagerly, through the graph runner's static buffers
    (off CUDA: its forward runs eagerly on them), as CUDA graphs, or compiled (--cpu-compile)."""
    if decode == "cuda_graphs":
        return make_tiny_engine(config_path, device="cuda", cuda_graph=True, overlap_schedule=True, **BLOCK)
    if decode == "cpu_compile":  # graphs of 1, 2 and 4 rows only: each costs a compile
        return make_tiny_engine(config_path, device="cpu", cpu_compile=True, max_num_seqs=4, **BLOCK)
    # the CPU, also on a GPU machine (there the default device would capture CUDA graphs)
    eng = make_tiny_engine(config_path, device="cpu", overlap_schedule=decode == "graph_runner", **BLOCK)
    if decode == "graph_runner":
        r = eng.runner
        r.graphs = GraphRunner(r.model, r.attn, max_bs=16, max_model_len=eng.max_model_len, device=r.device,
                               future=r.future)
        # off CUDA each run returns fresh tensors; a replay returns views of one static buffer,
        # rewritten by the next replay (under overlap, before the engine reads this step's rows)
        run, static = r.graphs.run, {}

        def replay_into_a_static_buffer(batch):
            logits, hidden = run(batch)
            buf = static.setdefault("hidden", hidden.new_empty(16, hidden.shape[1]))
            buf[: len(hidden)] = hidden
            return logits, buf[: len(hidden)]

        r.graphs.run = replay_into_a_static_buffer
    return eng


class EveryOtherStep:
    """Drafts on every other call, none on the rest."""

    def __init__(self, inner: OracleProposer) -> None:
        self.inner, self.calls = inner, 0

    def propose(self, batch: list[DraftInput]) -> list[list[int]]:
        self.calls += 1
        return self.inner.propose(batch) if self.calls % 2 else [[] for _ in batch]


@pytest.mark.parametrize("decode", [
    "eager", "graph_runner", "cpu_compile",
    pytest.param("cuda_graphs", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_the_head_drafts_from_the_targets_hidden_state_of_the_last_tokens_row(tiny_config_path, decode):
    """What the engine hands the head: the final hidden state at the row that sampled the
    sequence's last token, i.e. the target's hidden state at position len - 2 of its ids. Checked
    against a fresh eager engine that prefills those ids and samples from that very position,
    whichever way the decode steps ran (a graph's hidden states live in a static buffer the next
    replay overwrites, while the engine reads them a step later)."""
    eng = block_engine(tiny_config_path, decode)
    # the head's pass runs, but on every other step its drafts are the plain run's tokens (verifies
    # keep some: the last token's row is often not a verify's first; the random head alone kept none
    # on CUDA) and on the others none (plain decode steps: the path under test)
    plain = make_tiny_engine(tiny_config_path, device=eng.config.device)
    for i, p in enumerate(prompts(6)):
        plain.add_request(f"r{i}", p, GREEDY)
    runs = collect(drain(plain))
    eng.spec.proposer.oracle = EveryOtherStep(OracleProposer(
        eng.spec.proposer.k, {tuple(p): runs[(f"r{i}", 0)]["ids"] for i, p in enumerate(prompts(6))}))
    seen: list[DraftInput] = []
    propose = eng.spec.proposer.propose
    eng.spec.proposer.propose = lambda batch: (seen.extend(batch), propose(batch))[1]
    steps = []
    if eng.runner.graphs is not None:
        run = eng.runner.graphs.run
        eng.runner.graphs.run = lambda batch: steps.append(batch.num_seqs) or run(batch)
    for i, p in enumerate(prompts(6)):
        eng.add_request(f"r{i}", p, GREEDY)
    drain(eng)
    assert (len(steps) > 0) == (decode != "eager")  # the decode steps took the path under test
    assert all(x.hidden is not None for x in seen)
    assert eng.spec.stats.accepted_tokens > 0  # some verifies kept drafts: the last row is not the first
    ref = make_tiny_engine(tiny_config_path, device=eng.config.device, enable_prefix_cache=False)
    for x in seen:
        ref.add_request("ref", x.token_ids[:-1].tolist(), SamplingParams(temperature=0.0, max_tokens=1))
        out = drain(ref)
        assert out[-1].new_token_ids == [int(x.token_ids[-1])]  # that row's greedy token is the last one
        torch.testing.assert_close(x.hidden, ref.runner.last_hidden[-1], rtol=1e-4, atol=1e-4)


def test_scheduled_lengths_vary_and_output_is_unchanged(tiny_config_path, tmp_path):
    """The schedule on, with a cost that makes only confident positions pay: steps verify
    different numbers of positions per sequence, and output is what it is without speculation."""
    reqs = [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts(6))]
    plain = make_tiny_engine(tiny_config_path)
    eng = make_tiny_engine(tiny_config_path, speculative_algorithm="block")
    eng.spec.cost = AlwaysSpeculate()  # the on/off blocks aside: every step asks for drafts
    lengths: list[tuple[int, int]] = []  # (verified, room) per sequence and step
    proposer = eng.spec.proposer
    proposer.head.out_norm.weight.data *= 40  # a sharper head: confidences spread over (0, 1), not ~1/vocab
    proposer.cost = LinearCost(1.0, 0.05)  # a row costs 5 % of a step: only likely positions pay
    propose = proposer.propose
    proposer.propose = lambda batch: [lengths.append((len(d), min(x.max_draft, 4))) or d
                                      for x, d in zip(batch, propose(batch))]
    for e in (plain, eng):
        for rid, ids, params in reqs:
            e.add_request(rid, ids, params)
    a, b = collect(drain(plain)), collect(drain(eng))
    assert {key: v["ids"] for key, v in b.items()} == {key: v["ids"] for key, v in a.items()}
    # the confidences chose: some drafts cut short, some whole, some not verified at all
    assert any(0 < n < room for n, room in lengths) and any(n == room > 0 for n, room in lengths), lengths
    assert any(n == 0 < room for n, room in lengths), lengths
    assert_drained(eng)
