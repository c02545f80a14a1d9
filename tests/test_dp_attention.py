"""DP attention through the engine (CPU, gloo, 2 ranks): `LLM(..., tensor_parallel_size=2, ep_size=2,
enable_dp_attention=True)` runs an engine per rank, each over its own requests, whose forwards meet
in the MoE layers (a rank with nothing scheduled runs an idle forward). On tiny random Qwen3-MoE
and DeepSeek-V3 checkpoints it gives the one-rank greedy ids: requests spread over both ranks,
a long prompt in chunks, a lone request beside an idle rank, EPLB re-placing experts; every page
returns on every rank; bad input raises on the caller and the ranks keep serving. A dense model
and DP attention without expert parallelism are refused naming the field; `ketch serve` runs it
behind the openai SDK, and a killed rank (either) ends the other."""
from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta

import openai
import pytest
import torch
from server_util import gone, metrics, running_server
from test_tp_server import DEATH_DEADLINE_S, engine_and_worker

from ketch.config import EngineConfig
from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

QWEN = ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                               num_experts_per_tok=2, norm_topk_prob=True))
DEEPSEEK = ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                                     first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                                     n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
                                     topk_group=2, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
                                     qk_rope_head_dim=16, v_head_dim=32, norm_topk_prob=True,
                                     routed_scaling_factor=2.5, tie_word_embeddings=False))
COMMON = dict(vocab_size=301, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, initializer_range=0.3)
# six requests (three per rank), one longer than a step's 32-token budget (prefilled in chunks)
PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 45, 3)] + [[250, 3, 77, 9], [11, 12, 13, 14, 15]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
DP = dict(tensor_parallel_size=2, ep_size=2, enable_dp_attention=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_llm(path: str, **kw) -> LLM:
    kw.setdefault("overlap_schedule", False)
    return LLM(path, tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
               kv_cache_memory=4 << 20, page_size=8, max_num_batched_tokens=32, **kw)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, PARAMS)]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A tiny checkpoint's path and its one-rank greedy ids."""
    import transformers

    cls, extra = QWEN if request.param == "qwen3_moe" else DEEPSEEK
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **extra),
                                                  dtype=torch.float32).save_pretrained(path)
    llm = make_llm(str(path))
    try:
        ref = greedy(llm, PROMPTS)
    finally:
        llm.close()
    assert len({tuple(ids) for ids in ref}) == len(PROMPTS)  # varied output: a wrong rank's rows would show
    return str(path), ref


def test_dp_attention_gives_the_one_rank_ids(checkpoint):
    path, ref = checkpoint
    llm = make_llm(path, **DP)
    engine = llm.engine
    try:
        for i, p in enumerate(PROMPTS):  # where the requests go: the least loaded rank, ties in turn
            engine.add_request(f"spread-{i}", p, PARAMS)
        assert sorted(engine.requests.values()) == [0, 0, 0, 1, 1, 1]
        for i in range(len(PROMPTS)):
            engine.abort(f"spread-{i}")
        while engine.has_unfinished():
            engine.step()
        assert not engine.requests
        assert greedy(llm, PROMPTS) == ref
        assert greedy(llm, PROMPTS[2:3]) == ref[2:3]  # rank 1 idles through every forward
        with pytest.raises(ValueError, match="prompt"):
            llm.generate([[5, 400]], PARAMS)  # 400 is past the vocabulary
        assert greedy(llm, PROMPTS[:2]) == ref[:2]  # still serving, on both ranks
        engine.check_invariants()  # on every rank
        # the ranks wait for rank 0's next tick however long the server idles (torch's default: 30 minutes)
        assert engine._link.group._get_backend(torch.device("cpu")).options._timeout >= timedelta(days=30)
        stats = engine.stats()
        assert stats.kv_pages_in_use == 0 and stats.num_running == stats.num_waiting == 0
        assert stats.kv_pages_total == 2 * engine.runner.pool.num_pages  # the ranks' pools summed
    finally:
        llm.close()


def test_dp_attention_with_eplb_gives_the_one_rank_ids(checkpoint):
    """Two redundant expert slots, re-placed every 2 forwards (the idle ones count on every rank),
    with overlap scheduling (a step launches before the last one is processed)."""
    path, ref = checkpoint
    llm = make_llm(path, ep_num_redundant_experts=2, enable_eplb=True, eplb_rebalance_num_iterations=2,
                   overlap_schedule=True, **DP)
    try:
        assert greedy(llm, PROMPTS) == ref
        assert llm.engine.runner.model.eplb.rebalances >= 5
    finally:
        llm.close()


def test_dense_models_and_dp_without_ep_are_refused(tiny_config_path):
    with pytest.raises(ValueError, match="enable_dp_attention"):
        EngineConfig(tensor_parallel_size=2, enable_dp_attention=True)
    with pytest.raises(ValueError, match="enable_dp_attention: the model has no routed experts"):
        LLM(tiny_config_path, load_format="dummy", tokenizer=default_model_path(), device="cpu", num_threads=1,
            **DP)


TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def serve_dp2(path: str):
    return running_server("--model", path, "--load-format", "dummy", "--tokenizer", default_model_path(),
                          "--tp", "2", "--ep-size", "2", "--enable-dp-attention")


def test_ketch_serve_runs_dp_attention_and_a_dead_rank_ends_it(tmp_path):
    """`ketch serve --tp 2 --ep-size 2 --enable-dp-attention` on dummy weights: completions, streamed
    and not, give the one-rank engine's text for the same token prompts, and /metrics counts both
    ranks' tokens; then rank 1 is killed and
    the server exits, naming it, instead of hanging in a collective."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(100, 130))]
    kw = dict(load_format="dummy", tokenizer=default_model_path(), device="cpu", dtype="float32", num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(tmp_path), **kw)
    try:
        want = [out.text for out in llm.generate(prompts, params)]
    finally:
        llm.close()
    with serve_dp2(str(tmp_path)) as (server, base):
        engine, rank1 = engine_and_worker(server)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        args = dict(model=client.models.list().data[0].id, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
        got = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
        streamed = ["".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **args))
                    for p in prompts]
        assert got == streamed == want
        counts = metrics(base)  # the ranks' counts, summed
        assert counts["ketch_generation_tokens_total"] == 2 * 2 * 8, counts  # 2 prompts x 8 tokens, twice
        os.kill(rank1, signal.SIGKILL)
        code = server.wait(timeout=DEATH_DEADLINE_S)
        output = server.stdout.read()
        assert code != 0 and f"DP-attention rank 1 (pid {rank1}) exited with code -9" in output, output
        assert gone(engine)


def test_a_killed_engine_process_ends_rank_1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    with serve_dp2(str(tmp_path)) as (server, _):
        engine, rank1 = engine_and_worker(server)
        os.kill(engine, signal.SIGKILL)
        assert server.wait(timeout=DEATH_DEADLINE_S) != 0
        deadline = time.monotonic() + DEATH_DEADLINE_S
        while not gone(rank1):  # its collective with a closed peer fails
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.1)  # polling interval, not a synchronisation
