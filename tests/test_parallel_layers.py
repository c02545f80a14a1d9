"""Tensor-parallel layers: TP=2 on a real gloo group (two processes on the CPU) against the
unsharded layers in fp32. Every rank loads its shard from the same full tensors through the
layer's own weight_loader; together the ranks must give the TP=1 outputs."""
from __future__ import annotations

import pytest
import torch

from gloo_util import run_on_ranks
from ketch.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    StackedLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ketch.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ketch.parallel import SINGLE, ParallelContext

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, TOKENS = 32, 4, 2, 8, 48, 37, 5  # odd vocab: padded shards
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
LATENT = 11  # DeepSeek's kv_a: whole on every rank, an odd width that could not be split


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "x": r(TOKENS, HIDDEN), "x_inter": r(TOKENS, INTER), "ids": torch.randint(0, VOCAB, (TOKENS,), generator=g),
        "col.w": r(INTER, HIDDEN), "col.b": r(INTER),
        "row.w": r(HIDDEN, INTER), "row.b": r(HIDDEN),
        "q.w": r(Q, HIDDEN), "k.w": r(KV, HIDDEN), "v.w": r(KV, HIDDEN), "q.b": r(Q), "k.b": r(KV), "v.b": r(KV),
        "gate.w": r(INTER, HIDDEN), "up.w": r(INTER, HIDDEN), "lat.w": r(LATENT, HIDDEN), "lat.b": r(LATENT),
        "embed.w": r(VOCAB, HIDDEN), "head.w": r(VOCAB, HIDDEN),
    }


def build_and_run(parallel: ParallelContext) -> dict[str, torch.Tensor]:
    """Every layer built for `parallel`, loaded from the full tensors, run on the full inputs
    (a row-parallel layer on this rank's slice of its input, as a column-parallel one hands it)."""
    t = full_tensors()
    col = ColumnParallelLinear(HIDDEN, INTER, bias=True, parallel=parallel)
    col.weight_loader(col.weight, t["col.w"])
    col.weight_loader(col.bias, t["col.b"])
    row = RowParallelLinear(INTER, HIDDEN, bias=True, parallel=parallel)
    row.weight_loader(row.weight, t["row.w"])
    row.weight_loader(row.bias, t["row.b"])
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, parallel=parallel)
    for part in "qkv":
        qkv.weight_loader(qkv.weight, t[f"{part}.w"], part)
        qkv.weight_loader(qkv.bias, t[f"{part}.b"], part)
    merged = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], parallel=parallel)
    merged.weight_loader(merged.weight, t["gate.w"], 0)
    merged.weight_loader(merged.weight, t["up.w"], 1)
    # DeepSeek's q | kv_a: q's rows split (no bias, as HF's q_proj), the latent's whole (biased)
    stacked = StackedLinear(HIDDEN, (Q, LATENT), split=(True, False), biased=(False, True), parallel=parallel)
    stacked.weight_loader(stacked.weight, t["q.w"], 0)
    stacked.weight_loader(stacked.weight, t["lat.w"], 1)
    stacked.weight_loader(stacked.bias, t["lat.b"], 1)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, parallel=parallel)
    embed.weight_loader(embed.weight, t["embed.w"])
    head = ParallelLMHead(VOCAB, HIDDEN, parallel=parallel)
    head.weight_loader(head.weight, t["head.w"])
    x_inter = parallel.shard(t["x_inter"], 1)
    with torch.inference_mode():
        return {"col": col(t["x"]), "row": row(x_inter), "qkv": qkv(t["x"]), "merged": merged(t["x"]),
                "stacked": stacked.parts(stacked(t["x"])), "embed": embed(t["ids"]), "head": head(t["x"]), "tied_head": embed.project(t["x"])}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    return build_and_run(SINGLE), run_on_ranks(build_and_run, 2, tmp_path_factory.mktemp("tp2"))


def halves(t: torch.Tensor, rank: int, dim: int = -1) -> torch.Tensor:
    return t.chunk(2, dim)[rank]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unsharded_layers_are_the_plain_products(outputs):
    ref, _ = outputs
    t = full_tensors()
    lin = torch.nn.functional.linear
    assert torch.equal(ref["col"], lin(t["x"], t["col.w"], t["col.b"]))
    assert torch.equal(ref["row"], lin(t["x_inter"], t["row.w"], t["row.b"]))
    fused_w = torch.cat([t["q.w"], t["k.w"], t["v.w"]])
    assert torch.equal(ref["qkv"], lin(t["x"], fused_w, torch.cat([t["q.b"], t["k.b"], t["v.b"]])))
    assert torch.equal(ref["merged"], lin(t["x"], torch.cat([t["gate.w"], t["up.w"]])))
    assert torch.equal(ref["embed"], t["embed.w"][t["ids"]])
    assert torch.equal(ref["head"], t["x"] @ t["head.w"].t())


def test_column_parallel_gives_each_rank_its_output_slice(outputs):
    ref, ranks = outputs
    for rank, out in enumerate(ranks):
        close(out["col"], halves(ref["col"], rank))


def test_row_parallel_sums_the_partial_products(outputs):
    ref, ranks = outputs
    for out in ranks:
        close(out["row"], ref["row"])  # bias added once, after the all-reduce


def test_qkv_parallel_splits_q_and_kv_heads(outputs):
    ref, ranks = outputs
    q, k, v = ref["qkv"].split([Q, KV, KV], -1)
    for rank, out in enumerate(ranks):
        assert out["qkv"].shape == (TOKENS, (Q + 2 * KV) // 2)
        close(out["qkv"], torch.cat([halves(q, rank), halves(k, rank), halves(v, rank)], -1))


def test_merged_column_parallel_holds_a_slice_of_each_part(outputs):
    ref, ranks = outputs
    gate, up = ref["merged"].chunk(2, -1)
    for rank, out in enumerate(ranks):
        close(out["merged"], torch.cat([halves(gate, rank), halves(up, rank)], -1))


def test_stacked_linear_splits_some_parts_and_keeps_others_whole(outputs):
    ref, ranks = outputs
    t = full_tensors()
    q, latent = ref["stacked"]
    # (close, not equal: one product over the stacked weight need not sum in the single products'
    # order; MKL on an AMD EPYC does not)
    close(q, torch.nn.functional.linear(t["x"], t["q.w"]))  # the part without a bias adds none
    close(latent, torch.nn.functional.linear(t["x"], t["lat.w"], t["lat.b"]))
    for rank, out in enumerate(ranks):
        assert [p.shape[-1] for p in out["stacked"]] == [Q // 2, LATENT]
        close(out["stacked"][0], halves(q, rank))
        close(out["stacked"][1], latent)


def test_stacked_linear_refuses_a_bias_its_part_has_not():
    stacked = StackedLinear(HIDDEN, (Q, LATENT), split=(True, False), biased=(False, True))
    assert stacked.param_shard_ids("weight") == (0, 1) and stacked.param_shard_ids("bias") == (1,)
    with pytest.raises(ValueError, match="part 0 of this projection has no bias"):
        stacked.weight_loader(stacked.bias, torch.zeros(Q), 0)
    with pytest.raises(ValueError, match="split: 1 flags for 2 parts"):
        StackedLinear(HIDDEN, (Q, LATENT), split=(True,))


def test_vocab_parallel_embedding_and_lm_head_give_the_whole(outputs):
    ref, ranks = outputs
    for out in ranks:
        assert torch.equal(out["embed"], ref["embed"])  # one real row per token, the others add 0
        assert out["head"].shape == out["tied_head"].shape == (TOKENS, VOCAB)
        close(out["head"], ref["head"])
        close(out["tied_head"], ref["tied_head"])


def test_kv_heads_that_do_not_split_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads: 1 kv heads .* tensor parallel size 2"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, 1, parallel=ParallelContext(0, 2))
    with pytest.raises(ValueError, match="num_kv_heads: 3 heads do not form groups over 2 kv heads"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, 3, 2, parallel=ParallelContext(1, 3 - 1))
    with pytest.raises(ValueError, match="intermediate_size: 5 does not split"):
        MergedColumnParallelLinear(HIDDEN, [5, 5], parallel=ParallelContext(0, 2), field="intermediate_size")


def test_parallel_context_checks_its_fields_and_needs_a_group_for_collectives():
    with pytest.raises(ValueError, match="rank"):
        ParallelContext(rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        ParallelContext(rank=0, world_size=0)
    planning = ParallelContext(1, 2)  # shapes only
    assert planning.split(8, "x") == 4 and torch.equal(planning.shard(torch.arange(4), 0), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="without a process group"):
        planning.all_reduce(torch.zeros(2))
    assert torch.equal(SINGLE.all_gather(torch.ones(2)), torch.ones(2))
