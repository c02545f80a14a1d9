"""Tensor parallelism through the engine (CPU, gloo, 2 ranks): `LLM(..., tensor_parallel_size=2)`
spawns rank 1 and gives the greedy token ids of TP=1, for tiny random Llama-3, Qwen2 and Qwen3
checkpoints (transformers `from_config` + `save_pretrained`), with overlap scheduling off and on
(on, rank 1 resolves the placeholders from the sampled ids rank 0 broadcasts)."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ketch import LLM, SamplingParams
from ketch.cli import build_parser
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from ketch.weights.source import default_model_path

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
            initializer_range=0.3)  # larger weights than the default: varied, not repetitive, ids
FAMILIES = {
    # odd vocab: the vocab-parallel embedding and head pad their shards
    "llama3": ("LlamaConfig", dict(vocab_size=301, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(vocab_size=300, tie_word_embeddings=True)),  # q/k/v biases, tied head
    "qwen3": ("Qwen3Config", dict(vocab_size=300, head_dim=32, tie_word_embeddings=False)),  # q/k norms
}
# prompts of several lengths, so one step mixes prefill chunks with decode rows
PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 33)] + [[250, 3, 77, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_each() -> Iterator[None]:
    """Two ranks on a small shared box: one torch thread each (num_threads=1), restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The checkpoint's path and its TP=1 greedy ids (the same with overlap on or off)."""
    import transformers

    cls_name, extra = FAMILIES[request.param]
    cfg = getattr(transformers, cls_name)(**BASE, **extra)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ref = greedy_ids(str(path), 1, overlap=False)
    assert all(len(ids) == PARAMS.max_tokens for ids in ref)
    return str(path), ref


def greedy_ids(path: str, tp: int, overlap: bool) -> list[list[int]]:
    # the checkpoint has no tokenizer of its own; the prompts are ids (all below its vocab)
    llm = LLM(path, tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1, kv_cache_memory=4 << 20, page_size=8,
              max_num_batched_tokens=32, tensor_parallel_size=tp, overlap_schedule=overlap)
    try:
        if tp > 1:
            # the workers wait in a collective for rank 0's next step however long the server
            # idles: torch's default timeout (30 minutes) would end them (tp_ranks.RANK_WAIT)
            assert dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout >= timedelta(days=30)
        return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_tp2_greedy_ids_equal_tp1(checkpoint, overlap):
    path, ref = checkpoint
    assert greedy_ids(path, 2, overlap) == ref


def test_tensor_parallel_size_is_validated(checkpoint):
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(tensor_parallel_size=bad)
    # 2 kv heads cannot go to 3 ranks: refused before any rank starts
    with pytest.raises(ValueError, match="num_kv_heads: 2 kv heads .* size 3"):
        greedy_ids(checkpoint[0], 3, overlap=False)


@pytest.mark.parametrize("argv", [["generate", "x"], ["chat"], ["serve"], ["bench", "offline"],
                                  ["bench", "one-batch"]])
def test_every_engine_command_takes_tp(argv):
    for flag in ("--tp", "--tensor-parallel-size"):
        args = build_parser().parse_args([*argv, flag, "2"])
        assert EngineConfig(**engine_kwargs(args)).tensor_parallel_size == 2


def test_rank0_failing_at_start_kills_its_workers_and_raises(checkpoint, monkeypatch):
    """Rank 0's runner fails after rank 1 started (rank 1 then waits in a collective forever):
    the error reaches the caller, rank 1 is gone, the watcher did not end this process, and
    the group is released (a TP engine can start again)."""
    import ketch.engine.build as engine_module  # the composition root builds the ranks and the runner

    started: list = []

    def failing_runner(*args, **kwargs):
        started.extend(engine_module.TensorParallelRanks.last.procs)
        raise RuntimeError("rank 0 cannot build its runner")

    real_init = engine_module.TensorParallelRanks.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        engine_module.TensorParallelRanks.last = self

    monkeypatch.setattr(engine_module.TensorParallelRanks, "__init__", remember)
    monkeypatch.setattr(engine_module, "ModelRunner", failing_runner)
    with pytest.raises(RuntimeError, match="rank 0 cannot build its runner"):
        greedy_ids(checkpoint[0], 2, overlap=False)
    assert started and all(not p.is_alive() for p in started)
    monkeypatch.undo()
    assert greedy_ids(checkpoint[0], 2, overlap=False) == checkpoint[1]


def test_ranks_are_told_a_port_rank0_already_listens_on(checkpoint, monkeypatch):
    """Rank 0's store is bound before the ranks start, so the port they are given cannot be taken
    in between by another connection on the machine (a port picked free, closed and bound only
    after the spawn was, once: rank 0 failed with EADDRINUSE). At spawn time nobody else can bind it."""
    import ketch.engine.tp_ranks as tp_ranks

    held: list[bool] = []
    real = tp_ranks.RankProcesses

    def spawn_after_checking(target, args, n, what):
        port = args(1)[5]  # run_worker(config, model_config, max_model_len, source, rank, port, parent_pid)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                held.append(False)
            except OSError:
                held.append(True)
        return real(target, args, n, what)

    monkeypatch.setattr(tp_ranks, "RankProcesses", spawn_after_checking)
    assert greedy_ids(checkpoint[0], 2, overlap=False) == checkpoint[1]
    assert held == [True]
