"""Expert parallelism, DP attention and EPLB on two ranks of a real gloo group (tests/gloo_util.py)
against the one-rank model of tests/test_parallel_llama.py (the tiny random Qwen3-MoE and
Mixtral: hidden 64, 8 experts, top 2), logits within 1e-5 (fp32) over a prefill and two decode
steps:

    ep            experts split 4 + 4, attention TP, one all-reduce after the experts
    ep_a2a        the same with all-to-all dispatch / combine
    dp_gather     DP attention (rank 0 runs both sequences, rank 1 only the second: different
                  token counts), the MoE over the all-gathered tokens
    dp_a2a        DP attention with all-to-all dispatch
    eplb          ep + 2 redundant experts, re-placed after every forward (weights moved)
    dp_a2a_eplb   dp_a2a + 2 redundant experts re-placed after every forward (load summed)

One spawn runs every case (two ranks on a 2-core box)."""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from gloo_util import run_on_ranks
from test_parallel_llama import CONFIGS, DECODE_IDS, PAGE, PROMPTS, checkpoint, run_model
from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.layers.moe import fused_experts_ref
from ketch.layers.moe_ep import ExpertParallelMoE, initial_placement
from ketch.layers.moe_routing import softmax_topk
from ketch.models.registry import config_from_hf, family_for
from ketch.parallel import SINGLE, ExpertParallel, ParallelContext

FAMILIES = ("qwen3_moe", "mixtral")
MODES = {
    "ep": ExpertParallel(2),
    "ep_a2a": ExpertParallel(2, "all_to_all"),
    "dp_gather": ExpertParallel(2, dp_attention=True),
    "dp_a2a": ExpertParallel(2, "all_to_all", dp_attention=True),
    "eplb": ExpertParallel(2, num_redundant=2, eplb_interval=1),
    "dp_a2a_eplb": ExpertParallel(2, "all_to_all", dp_attention=True, num_redundant=2, eplb_interval=1),
}
DP_SEQS = {0: (0, 1), 1: (1,)}  # DP attention: the sequences each rank runs


@torch.inference_mode()
def run(parallel: ParallelContext, family: str) -> list:
    """This rank's sequences (both; under DP attention DP_SEQS'), each step's logits, then what
    the MoE layers hold."""
    cfg = config_from_hf(CONFIGS[family])
    declared = family_for(cfg.architecture)
    model = declared.model_class(cfg, max_positions=64, parallel=parallel)
    model.load_weights(checkpoint(cfg).items())
    spec = declared.kv_spec(cfg, parallel)  # DP attention: every head
    assert spec.tensors[0].shape == (parallel.for_attention().head_share(cfg.num_heads, cfg.num_kv_heads).num_kv,
                                     cfg.head_dim)
    attn = TorchAttentionBackend(KVPool(spec, 8, PAGE, torch.float32, "cpu"), cfg.head_dim, torch.device("cpu"))
    mine = DP_SEQS[parallel.rank] if parallel.ep.dp_attention else (0, 1)
    prompts, tables = [PROMPTS[s] for s in mine], [[3 * s, 3 * s + 1, 3 * s + 2] for s in mine]
    steps = [([SeqChunk(0, len(p), t) for p, t in zip(prompts, tables)], sum(prompts, []),
              [i for p in prompts for i in range(len(p))])]
    lens = [len(p) for p in prompts]
    for step in DECODE_IDS:
        steps.append(([SeqChunk(n, 1, t) for n, t in zip(lens, tables)], [step[s] for s in mine], list(lens)))
        lens = [n + 1 for n in lens]
    out = []
    for seqs, ids, pos in steps:
        meta = attn.init_metadata(ForwardBatch.build(seqs, PAGE))
        out.append(model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), attn, meta)))
    experts = [layer.mlp.experts for layer in model.layers if cfg.is_sparse(layer.self_attn.layer)]
    return out + [dict(phy2log=[e.phy2log.clone() for e in experts], local=[e.local_experts() for e in experts],
                       w13=[e.w13.clone() for e in experts], rebalances=model.eplb.rebalances if model.eplb else 0,
                       load=model.expert_load.snapshot())]


@torch.inference_mode()
def layer_with_an_empty_rank(parallel: ParallelContext) -> torch.Tensor:
    """all-to-all MoE where rank 1 has no tokens: rank 0's output is the one-rank reference's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=g)
    select = partial(softmax_topk, top_k=2, renormalize=True)
    moe = ExpertParallelMoE(16, 8, 12, select, parallel=replace(parallel, ep=ExpertParallel(2, "all_to_all", True)))
    gate, w13, w2 = torch.randn(8, 16, generator=g), torch.randn(8, 24, 16, generator=g), torch.randn(8, 16, 12, generator=g)
    moe.gate.weight.copy_(gate)
    for slot, e in enumerate(moe.experts.local_experts()):
        moe.experts.w13[slot].copy_(w13[e])
        moe.experts.w2[slot].copy_(w2[e])
    got = moe(x if parallel.rank == 0 else x[:0])
    return got, fused_experts_ref(x, w13, w2, *select(x @ gate.T))


def _every_case(parallel: ParallelContext) -> dict:
    out = {"layer": layer_with_an_empty_rank(parallel)}
    for mode, ep in MODES.items():
        ctx = replace(parallel, ep=ep)
        for family in FAMILIES:
            out[mode, family] = run(ctx, family)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[dict, list[dict]]:
    ranks = run_on_ranks(_every_case, 2, tmp_path_factory.mktemp("ep2"))
    return {f: run_model(SINGLE, f) for f in FAMILIES}, ranks


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == torch.float32, what
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=lambda m: f"{what}: {m}")


def _expected(ref: list[torch.Tensor], mode: str, rank: int) -> list[torch.Tensor]:
    """The one-rank logits of the rows this rank ran."""
    if not MODES[mode].dp_attention or rank == 0:
        return ref
    start = len(PROMPTS[0])
    return [ref[0][start:]] + [step[1:] for step in ref[1:]]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_two_ranks_give_the_one_rank_logits(cases, mode, family):
    ref, ranks = cases
    for rank, got in enumerate(ranks):
        logits = got[mode, family][:-1]
        want = _expected(ref[family], mode, rank)
        assert len(logits) == len(want) == 1 + len(DECODE_IDS)
        for step, (a, b) in enumerate(zip(logits, want, strict=True)):
            _close(a, b, f"{mode} {family} rank {rank} step {step}")


def test_each_rank_loads_its_own_experts(cases):
    ref, ranks = cases
    for rank, got in enumerate(ranks):
        info = got["ep", "qwen3_moe"][-1]
        assert info["local"] == [list(range(4 * rank, 4 * rank + 4))] * 2  # two sparse layers
        ckpt = checkpoint(config_from_hf(CONFIGS["qwen3_moe"]))
        gate = ckpt[f"model.layers.0.mlp.experts.{4 * rank}.gate_proj.weight"]
        torch.testing.assert_close(info["w13"][0][0, : gate.shape[0]], gate, rtol=0, atol=0)


def test_eplb_moved_experts_every_step(cases):
    _, ranks = cases
    start = initial_placement(8, 10)
    for mode in ("eplb", "dp_a2a_eplb"):
        for family in FAMILIES:
            infos = [r[mode, family][-1] for r in ranks]
            assert all(i["rebalances"] == 1 + len(DECODE_IDS) for i in infos)
            assert all(torch.equal(p, q) for p, q in zip(infos[0]["phy2log"], infos[1]["phy2log"]))  # one plan
            assert any(not torch.equal(p, start) for p in infos[0]["phy2log"]), (mode, family)
            for p in infos[0]["phy2log"]:
                assert sorted(set(p.tolist())) == list(range(8))


def test_expert_load_counts_every_pick(cases):
    _, ranks = cases
    tokens = sum(map(len, PROMPTS)) + len(PROMPTS) * len(DECODE_IDS)
    for rank, got in enumerate(ranks):
        load = got["ep", "mixtral"][-1]["load"]
        assert load.shape == (2, 8) and load.sum(dim=1).tolist() == [2 * tokens] * 2


def test_all_to_all_with_a_rank_that_has_no_tokens(cases):
    _, ranks = cases
    got, ref = ranks[0]["layer"]
    _close(got, ref, "rank 0")
    assert ranks[1]["layer"][0].shape == (0, 16)
