"""DeepSeek-V2/V3 under tensor parallelism through the engine (CPU, gloo, 2 ranks): the heads, the
dense, shared and routed experts' intermediate features and the vocabulary split over the ranks,
the latent KV whole on each; greedy ids equal one rank's on tiny random MoE checkpoints (V2:
softmax group-limited routing, no q LoRA; V3: sigmoid noaux_tc routing with q LoRA, shared
experts, a dense first layer), mixed prefill chunks and decode rows in one step; and with
expert parallelism (`--ep-size 2`) and EPLB re-placing the experts every 3 steps."""
from __future__ import annotations

import pytest
import torch

from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

BASE = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.3,
            eos_token_id=2, bos_token_id=1, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, n_routed_experts=8, moe_intermediate_size=16, first_k_dense_replace=1,
            n_shared_experts=1, n_group=4, topk_group=2, tie_word_embeddings=False)
CHECKPOINTS = {
    "v2": ("DeepseekV2Config", dict(q_lora_rank=None, num_experts_per_tok=3, topk_method="group_limited_greedy",
                                    routed_scaling_factor=2.0)),
    "v3": ("DeepseekV3Config", dict(q_lora_rank=48, num_experts_per_tok=2, norm_topk_prob=True,
                                    routed_scaling_factor=2.5)),
}
PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 33)] + [[250, 3, 77, 9]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy_ids(path: str, tp: int, rebalances: list | None = None, **kw) -> list[list[int]]:
    """The prompts' greedy ids; `rebalances` gets rank 0's count of EPLB re-placements."""
    llm = LLM(path, tokenizer=default_model_path(), dtype="float32", device="cpu", num_threads=1,
              kv_cache_memory=4 << 20, page_size=8, max_num_batched_tokens=32, tensor_parallel_size=tp, **kw)
    try:
        ids = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
        if rebalances is not None:
            rebalances.append(llm.engine.runner.model.eplb.rebalances)
        return ids
    finally:
        llm.close()


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A tiny checkpoint's path and its one-rank greedy ids."""
    import transformers

    cls, extra = CHECKPOINTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**BASE, **extra),
                                                  dtype=torch.float32).save_pretrained(path)
    ref = greedy_ids(str(path), 1)
    assert len({tuple(ids) for ids in ref}) == len(PROMPTS)  # varied output: a broken shard would show
    return str(path), ref


def test_tp2_greedy_ids_equal_tp1(checkpoint):
    path, ref = checkpoint
    assert greedy_ids(path, 2) == ref


def test_ep2_with_eplb_greedy_ids_equal_tp1(checkpoint):
    """Whole routed experts split over 2 ranks plus 2 redundant slots, re-placed every 3 forward
    steps (the shared experts and attention stay tensor-parallel)."""
    path, ref = checkpoint
    rebalances: list[int] = []
    assert greedy_ids(path, 2, rebalances, ep_size=2, ep_num_redundant_experts=2, enable_eplb=True,
                      eplb_rebalance_num_iterations=3) == ref
    assert rebalances[0] >= 5  # ~20 forward steps: the experts really moved, several times


def test_a_split_the_model_cannot_take_is_an_error_naming_it(tmp_path, capfd):
    """4 heads over 3 ranks: refused before any rank starts (the latent KV is whole on each rank, so
    the KV spec asked before the ranks start did not look at the heads, and every rank printed its
    own traceback). 17 intermediate features of an expert over 2 ranks fail inside each rank's
    build: rank 0 raises it (a worker that gets there before rank 0 ends it says it in one line)."""
    import transformers

    cls, extra = CHECKPOINTS["v3"]
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**BASE, "moe_intermediate_size": 17},
                                                                             **extra)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^num_attention_heads: 4 does not split evenly over tensor parallel size 3") as e:
        greedy_ids(str(tmp_path), 3)
    frames = {entry.name for entry in e.traceback}
    assert "kv_spec" in frames and "_load_model" not in frames, frames  # before the ranks, before any model
    assert "ketch-rank" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="^moe_intermediate_size: 17 does not split evenly over tensor parallel size 2"):
        greedy_ids(str(tmp_path), 2)
    assert "Traceback" not in capfd.readouterr().err
