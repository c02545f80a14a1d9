"""A tiny random Llama-family model built for TP=2 over gloo (two processes on the CPU) gives
the TP=1 logits (fp32): a prefill of two prompts, then two decode steps that read the KV each
rank keeps for its own kv heads (the torch attention backend over a small KVPool per rank).
The MoE family (Qwen3-MoE, Mixtral) too: each rank holds every expert's share of the
intermediate features, one all-reduce after the experts' down projection."""
from __future__ import annotations

import pytest
import torch

from gloo_util import run_on_ranks
from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.config import ModelConfig
from ketch.models.llama import LlamaForCausalLM
from ketch.models.llama_family import LLAMA
from ketch.models.registry import config_from_hf, family_for
from ketch.parallel import SINGLE, ParallelContext
from ketch.weights.dummy_loader import tensor_seed

BASE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
CONFIGS = {
    "llama": dict(BASE, model_type="llama", vocab_size=301, tie_word_embeddings=False),  # odd vocab: padded shards
    "qwen2": dict(BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=300,
                  tie_word_embeddings=True),  # q/k/v biases, tied head
    "qwen3": dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=300, head_dim=32,
                  tie_word_embeddings=False),  # q/k norms, head_dim != hidden / heads
    # SmolLM2's shape of heads: 3 kv heads in groups of 3 over 2 ranks, split 2 + 1 (head_share)
    "uneven": dict(BASE, model_type="llama", vocab_size=300, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=16, tie_word_embeddings=True),
    # sparse layers 0 and 2 (8 experts of 32 features, top 2), dense layer 1
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=300,
                      num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "mixtral": dict(BASE, model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=300,
                    num_local_experts=8, num_experts_per_tok=2),
}
PROMPTS = [[5, 17, 42, 9, 250, 3, 77], [8, 1, 299, 64, 12]]
DECODE_IDS = [[101, 7], [33, 290]]  # fixed inputs of the two decode steps (the same on both sides)
PAGE = 4


def checkpoint(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random values for every tensor (norms and biases too), seeded by name."""
    out = {}
    for name, shape in family_for(cfg.architecture).weight_shapes(cfg).items():
        noise = 0.1 * torch.randn(shape, generator=torch.Generator().manual_seed(tensor_seed(0, name)))
        out[name] = 1.0 + noise if name.endswith("norm.weight") else noise
    return out


@torch.inference_mode()
def run_model(parallel: ParallelContext, family: str) -> list[torch.Tensor]:
    """Each step's logits of every row (prefill) / of each sequence (decode)."""
    cfg = config_from_hf(CONFIGS[family])
    declared = family_for(cfg.architecture)
    model = declared.model_class(cfg, max_positions=64, parallel=parallel)
    model.load_weights(checkpoint(cfg).items())
    spec = declared.kv_spec(cfg, parallel)
    assert spec.tensors[0].shape == (parallel.head_share(cfg.num_heads, cfg.num_kv_heads).num_kv, cfg.head_dim)
    attn = TorchAttentionBackend(KVPool(spec, 8, PAGE, torch.float32, "cpu"), cfg.head_dim, torch.device("cpu"))
    tables = [[0, 1, 2], [3, 4, 5]]
    steps = [[SeqChunk(0, len(p), t) for p, t in zip(PROMPTS, tables)]]
    ids, positions = [sum(PROMPTS, [])], [[i for p in PROMPTS for i in range(len(p))]]
    lens = [len(p) for p in PROMPTS]
    for step in DECODE_IDS:
        steps.append([SeqChunk(n, 1, t) for n, t in zip(lens, tables)])
        ids.append(step)
        positions.append(list(lens))
        lens = [n + 1 for n in lens]
    logits = []
    for seqs, step_ids, pos in zip(steps, ids, positions, strict=True):
        hidden = model(torch.tensor(step_ids), torch.tensor(pos), attn, attn.init_metadata(ForwardBatch.build(seqs, PAGE)))
        logits.append(model.compute_logits(hidden))
    return logits


@pytest.fixture(scope="module")
def tp1_and_tp2(tmp_path_factory) -> dict[str, tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    out = tmp_path_factory.mktemp("tp2")
    ranks = run_on_ranks(_all_families, 2, out)
    return {f: (run_model(SINGLE, f), [r[f] for r in ranks]) for f in CONFIGS}


def _all_families(parallel: ParallelContext) -> dict[str, list[torch.Tensor]]:
    return {f: run_model(parallel, f) for f in CONFIGS}  # one spawn for all of them


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tp2_logits_equal_tp1(tp1_and_tp2, family):
    ref, ranks = tp1_and_tp2[family]
    for rank, got in enumerate(ranks):
        assert len(got) == len(ref) == 1 + len(DECODE_IDS)
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert a.shape == b.shape and a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(),
                                       msg=lambda m: f"rank {rank}, step {step}: {m}")


def test_the_compared_logits_are_not_trivial(tp1_and_tp2):
    """(The TP=1 side is the model the parity tests pin to HF transformers.)"""
    for family, (ref, _) in tp1_and_tp2.items():
        assert ref[0].shape == (sum(map(len, PROMPTS)), CONFIGS[family]["vocab_size"])
        assert all(step.std() > 0.1 for step in ref), family


def test_kv_spec_per_rank_and_heads_that_do_not_split():
    cfg = LLAMA.config_from_hf(CONFIGS["llama"])
    full = LLAMA.kv_spec(cfg, SINGLE).bytes_per_token(torch.float32)
    assert LLAMA.kv_spec(cfg, ParallelContext(1, 2)).bytes_per_token(torch.float32) * 2 == full
    with pytest.raises(ValueError, match="num_kv_heads"):
        LLAMA.kv_spec(cfg, ParallelContext(0, 4))
    with pytest.raises(ValueError, match="num_kv_heads"):
        LlamaForCausalLM(cfg, 64, parallel=ParallelContext(0, 4))
