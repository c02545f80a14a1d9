"""Expert parallelism through the engine (CPU, gloo, 2 ranks): `LLM(..., tensor_parallel_size=2,
ep_size=2, ep_num_redundant_experts=2, enable_eplb=True)` on a tiny random Qwen3-MoE checkpoint
gives the greedy ids of one rank while the experts are re-placed every 3 forward steps (both
ranks re-place after the same forward). The flags and their checks."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ketch import LLM, SamplingParams
from ketch.cli import build_parser
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from ketch.weights.source import default_model_path

PROMPTS = [list(range(5, 5 + n)) for n in (7, 19)] + [[250, 3, 77, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_each() -> Iterator[None]:
    """Two ranks on a small shared box: one torch thread each (num_threads=1), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what LLM(num_threads=1) sets: in place before each test's snapshot
    yield
    torch.set_num_threads(threads)


def greedy_ids(path: str, **kw) -> list[list[int]]:
    llm = LLM(path, tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
              kv_cache_memory=4 << 20, page_size=8, max_num_batched_tokens=32, overlap_schedule=False, **kw)
    try:
        return [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.close()


def test_ep2_with_eplb_gives_the_one_rank_ids(tmp_path):
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=300,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                                      initializer_range=0.3)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    ref = greedy_ids(str(tmp_path))
    assert len({tuple(ids) for ids in ref}) == len(PROMPTS)  # varied output
    assert greedy_ids(str(tmp_path), tensor_parallel_size=2, ep_size=2, ep_num_redundant_experts=2,
                      enable_eplb=True, eplb_rebalance_num_iterations=3) == ref


def test_ep_flags_reach_the_config():
    args = build_parser().parse_args(["generate", "x", "--tp", "2", "--ep-size", "2", "--enable-eplb",
                                      "--ep-num-redundant-experts", "2", "--eplb-rebalance-num-iterations", "5"])
    c = EngineConfig(**engine_kwargs(args))
    assert (c.ep_size, c.enable_eplb, c.ep_num_redundant_experts, c.eplb_rebalance_num_iterations) == (2, True, 2, 5)


@pytest.mark.parametrize("tp, add", [("1", "--tp 2 --ep-size 2"), ("4", "--ep-size 4")])
@pytest.mark.parametrize("flag", [["--enable-eplb"], ["--ep-num-redundant-experts", "4"]])
def test_the_hint_for_eplb_without_ep_is_a_setting_that_passes(tp, add, flag):
    """The message's flags, added on the command line, make a config that passes (it said
    `--ep-size 2` on one rank: the next error was ep_size against tensor_parallel_size 1)."""
    argv = ["generate", "x", "--tp", tp, *flag]
    with pytest.raises(ValueError, match=f"needs expert parallelism: add {add}$"):
        EngineConfig(**engine_kwargs(build_parser().parse_args(argv)))
    assert EngineConfig(**engine_kwargs(build_parser().parse_args(argv + add.split()))).ep_size > 1


@pytest.mark.parametrize("kw,field", [
    (dict(ep_size=0), "ep_size"), (dict(ep_size=2), "ep_size"), (dict(ep_size=2, tensor_parallel_size=4), "ep_size"),
    (dict(ep_num_redundant_experts=-1), "ep_num_redundant_experts"),
    (dict(ep_num_redundant_experts=2), "ep_num_redundant_experts"), (dict(enable_eplb=True), "enable_eplb"),
    (dict(eplb_rebalance_num_iterations=0), "eplb_rebalance_num_iterations"),
    (dict(enable_dp_attention=True, tensor_parallel_size=2), "enable_dp_attention"),
])
def test_bad_ep_settings_name_their_field(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)
