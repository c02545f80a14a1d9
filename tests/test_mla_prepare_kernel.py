"""An MLA layer's glue in one launch (ketch/kernels/mla_prepare.py) against `mla_prepare_ref`, and
that reference against the model's own torch glue (DeepseekAttention._prepare_torch) op for op:
q's rope part rotated in place (its nope part and other tokens untouched), the latent = normed c |
rotated k_pe, with and without DeepSeek's interleaved rope pairs, heads and rank that are not
powers of two, no tokens. Without CUDA the kernel runs in Triton's CPU interpreter (fp32, fp16)."""
import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels import mla_prepare as mla_prepare_module  # noqa: E402
from ketch.kernels.head_gemv import head_gemv  # noqa: E402
from ketch.kernels.mla_prepare import mla_prepare, mla_prepare_absorb, mla_prepare_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEADS, NOPE, ROPE, RANK = 3, 24, 16, 48
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def inputs(tokens: int, dtype: torch.dtype, seed: int = 0, rope: int = ROPE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, NOPE + rope, generator=g).to(DEVICE, dtype)
    ckv = (torch.randn(tokens, RANK + rope, generator=g) * 3).to(DEVICE, dtype)
    angles = torch.rand(tokens, rope // 2, generator=g) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None].to(DEVICE, dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None].to(DEVICE, dtype)  # ketch's signed rows
    weight = (torch.rand(RANK, generator=g) + 0.5).to(DEVICE, dtype)
    return q, ckv, cos, sin, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("rope", [ROPE, 12])  # 12: not a power of two (masked)
def test_equals_the_torch_glue(dtype, interleave, tokens, rope):
    q, ckv, cos, sin, weight = inputs(tokens, dtype, rope=rope)
    want_q, want_latent = mla_prepare_ref(q, ckv, cos, sin, weight, 1e-6, NOPE, interleave)
    before = q.clone()
    got_q, latent = mla_prepare(q, ckv, cos, sin, weight, 1e-6, NOPE, interleave)
    assert got_q.data_ptr() == q.data_ptr() and latent.shape == (tokens, RANK + rope)
    assert torch.equal(q[..., :NOPE], before[..., :NOPE])
    for got, want in ((q, want_q), (latent, want_latent)):
        torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])
    # the rope part really moved (a kernel that wrote nothing would fail the line above only by luck)
    assert not torch.allclose(q[..., NOPE:].float(), before[..., NOPE:].float())


@pytest.mark.parametrize("pool_dtype", [None, torch.float8_e4m3fn])
def test_the_latent_also_goes_into_the_pool_as_store_rows_puts_it(pool_dtype):
    """store=(pool, slots): each token's latent row lands in its slot exactly as store_rows would
    write it (fp8 pools: the same saturating conversion), a padding slot (< 0) writes nothing,
    no other row changes; q and the returned latent are what they are without store."""
    from ketch.kernels.kv_store import store_rows

    dtype = torch.float32
    q, ckv, cos, sin, weight = inputs(4, dtype, seed=9)
    pool = torch.randn(5, 4, RANK + ROPE, generator=torch.Generator().manual_seed(1)).to(DEVICE, pool_dtype or dtype)
    slots = torch.tensor([7, -1, 3, 19], dtype=torch.int32, device=DEVICE)  # row 0: a padding write would land there
    want_q, want_latent = mla_prepare(q.clone(), ckv, cos, sin, weight, 1e-6, NOPE, True)
    want_pool = pool.clone()
    store_rows(want_pool, want_latent, slots)
    got_q, got_latent = mla_prepare(q.clone(), ckv, cos, sin, weight, 1e-6, NOPE, True, store=(pool, slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_latent, want_latent)
    assert torch.equal(pool.view(torch.uint8), want_pool.view(torch.uint8))  # bits, fp8 included
    with pytest.raises(ValueError, match="slot per token"):
        mla_prepare(q.clone(), ckv, cos, sin, weight, 1e-6, NOPE, True, store=(pool, slots[:3]))


def test_no_tokens_and_bad_shapes():
    q, ckv, cos, sin, weight = inputs(0, torch.float32)
    got_q, latent = mla_prepare(q, ckv, cos, sin, weight, 1e-6, NOPE, True)
    assert got_q.shape == (0, HEADS, NOPE + ROPE) and latent.shape == (0, RANK + ROPE)
    q, ckv, cos, sin, weight = inputs(2, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        mla_prepare(q, ckv, cos, sin, weight[:-1], 1e-6, NOPE, True)
    with pytest.raises(ValueError, match="even"):
        mla_prepare(q[..., 1:], ckv, cos, sin, weight, 1e-6, NOPE, True)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_the_reference_is_the_models_torch_glue(name, tmp_path):
    """The kernel's reference is the same function as the model's torch path, bit for bit: what
    the kernel is checked against is what the CPU model (HF parity) computes."""
    from ketch.models.registry import load_model_config
    from ketch.layers.ops import TORCH_OPS
    from ketch.models.deepseek import DeepseekAttention

    d = json.loads((CONFIGS / name / "config.json").read_text())
    d.update(num_hidden_layers=1, hidden_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS,
             kv_lora_rank=RANK, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=32, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(d))
    attention = DeepseekAttention(load_model_config(str(tmp_path / "config.json"), "dummy"), 0, TORCH_OPS)
    assert attention._prepare == attention._prepare_torch
    q, ckv, cos, sin, weight = inputs(4, torch.float32)
    q, ckv, cos, sin, weight = q.cpu(), ckv.cpu(), cos.cpu(), sin.cpu(), weight.cpu()
    got = attention._prepare(q, ckv, cos, sin, weight, 1e-6, NOPE, attention.interleave)
    want = mla_prepare_ref(q, ckv, cos, sin, weight, 1e-6, NOPE, attention.interleave)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("pool_dtype", [None, torch.float8_e4m3fn])
def test_the_absorbed_launch_is_prepare_and_the_w_uk_product(dtype, tokens, pool_dtype):
    """mla_prepare_absorb: q, the latent, the pool rows and q_lat = head_gemv(q_nope, W_UK) as the
    two launches make them, bit for bit (the same code per program), q_lat from the nope part the
    prepare leaves alone."""
    q, ckv, cos, sin, weight = inputs(tokens, dtype, seed=tokens)
    w_uk = (torch.randn(HEADS, RANK, NOPE, generator=torch.Generator().manual_seed(4)) / 5).to(DEVICE, dtype)
    w_uk = w_uk.transpose(1, 2)  # [heads, nope, rank] as a strided view, as the model passes it
    pools = [torch.zeros(4, 2, RANK + ROPE, dtype=pool_dtype or dtype, device=DEVICE) for _ in range(2)]
    slots = torch.tensor([5, -1, 0][:tokens], device=DEVICE)
    want_q, want_latent = mla_prepare(q.clone(), ckv, cos, sin, weight, 1e-6, NOPE, True, store=(pools[0], slots))
    want_q_lat = head_gemv(q[:, :, :NOPE], w_uk)
    got_q, got_latent, got_q_lat = mla_prepare_absorb(q, ckv, cos, sin, weight, 1e-6, NOPE, True, w_uk,
                                                      store=(pools[1], slots))
    assert got_q_lat.shape == (tokens, HEADS, RANK)
    for got, want in ((got_q, want_q), (got_latent, want_latent), (got_q_lat, want_q_lat)):
        assert torch.equal(got, want)
    assert torch.equal(pools[1].float(), pools[0].float()) and pools[1].float().abs().sum() > 0
    with pytest.raises(ValueError, match="at most 8 rows"):
        mla_prepare_absorb(*inputs(9, dtype), 1e-6, NOPE, True, w_uk)


def test_a_batch_one_deepseek_engine_absorbs_the_query_in_the_prepare_launch(tmp_path):
    """At batch 1 every MLA layer's decode step makes q_lat in the prepare's launch (each layer
    and step once) and the tokens stay the torch path's."""
    from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config

    want, got, rows = batch_one_on_both_paths(cut_config("deepseek-v2-lite", tmp_path), DEVICE.type,
                                              mla_prepare_module, "plan_head_gemv", 5)
    assert rows == [1] * 2 * 4  # the cut's two MLA layers x the 4 decode steps after the prefill
    assert_same_tokens(want, got)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_a_deepseek_engine_on_the_triton_kernels_keeps_the_torch_paths_tokens(name, tmp_path):
    """End to end (fp32, dummy weights): the engine with the Triton attention and layer kernels
    (MLA prepare, MLA decode/extend, fused MoE with the shared experts folded in, routing: the
    interpreter without CUDA) gives the torch path's greedy tokens, logprobs within 1e-4, prefill
    and decode, pages shared by a prefix."""
    from conftest import greedy_ids_and_logprobs, make_tiny_engine

    d = json.loads((CONFIGS / name / "config.json").read_text())
    d.update(num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=96,
             moe_intermediate_size=16, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=RANK,
             qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE, v_head_dim=32, vocab_size=512)
    if d.get("q_lora_rank"):
        d["q_lora_rank"] = 48
    (tmp_path / "config.json").write_text(json.dumps(d))
    path = str(tmp_path / "config.json")
    prompts = [[5, 9, 11], list(range(3, 30)), list(range(3, 20)) + [7, 7]]
    device = DEVICE.type
    reference = make_tiny_engine(path, device=device, attention_backend="torch", layer_kernels="torch",
                                 cuda_graph=False)
    ids, lps = greedy_ids_and_logprobs(reference, prompts, 6)
    engine = make_tiny_engine(path, device=device, attention_backend="triton", layer_kernels="triton")
    assert engine.runner.ops.mla_prepare is mla_prepare
    # the shared experts run inside the fused MoE (slots after the routed experts), not as an MLP
    moe = engine.runner.model.layers[1].mlp
    assert moe.shared_experts is None and moe.experts.shared == d["n_shared_experts"]
    assert reference.runner.model.layers[1].mlp.shared_experts is not None
    # the logits through the ops' product (the skinny GEMM at decode rows on CUDA), as Llama's
    assert engine.runner.model.logits_head.dense is engine.runner.ops.linear
    assert reference.runner.model.logits_head.dense is None
    got_ids, got_lps = greedy_ids_and_logprobs(engine, prompts, 6)
    assert got_ids == ids
    for a, b in zip(got_lps, lps, strict=True):
        assert max(abs(u - v) for u, v in zip(a, b, strict=True)) < 1e-4
    engine.check_invariants()
    # /metrics' per-expert counts: the routed picks only, as many as the torch path's
    load, ref_load = engine.runner.expert_load.totals(), reference.runner.expert_load.totals()
    assert len(load[0]) == d["n_routed_experts"] and list(map(sum, load)) == list(map(sum, ref_load))
