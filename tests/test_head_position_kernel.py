"""kernels/head_position.py with the KV store: the heads put in position (Qwen3's head norms and
RoPE, or RoPE alone) and the new k and v written into the pool in one launch, the bits of the
separate kernels (qk_rms_norm / rotary, then store_kv); and end to end, a Llama / Qwen3 engine on
the Triton kernels, whose attention backend then skips its own store, keeps the torch tokens."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config  # noqa: E402

from ketch.kernels import head_position  # noqa: E402
from ketch.kernels.head_position import KVStore, qk_rms_norm, rotary_store  # noqa: E402
from ketch.kernels.kv_store import store_kv  # noqa: E402
from ketch.kernels.rotary import rotary  # noqa: E402
from ketch.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
NUM_Q, NUM_KV, DIM, PAGES, PAGE = 4, 2, 48, 6, 4  # dim not a power of two: a masked tail


def step(dtype: torch.dtype, seed: int, tokens: int = 5):
    """A fused qkv row per token (large values, as real ones), its rope rows, head-norm weights,
    and the step's slots: scattered over the pool, one of them padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (NUM_Q + 2 * NUM_KV) * DIM, generator=g) * 30).to(DEVICE, dtype)
    qk = qkv[:, : (NUM_Q + NUM_KV) * DIM].view(tokens, NUM_Q + NUM_KV, DIM)
    v = qkv[:, (NUM_Q + NUM_KV) * DIM :].view(tokens, NUM_KV, DIM)
    positions = torch.tensor([0, 3, 50, 127, 7, 9, 11][:tokens], device=DEVICE)
    cos, sin = RotaryEmbedding(DIM, 128, 10000.0, None).to(DEVICE).lookup(positions, dtype)
    weights = tuple(torch.randn(DIM, generator=g).to(DEVICE, dtype) for _ in range(2))
    slots = torch.randperm(PAGES * PAGE, generator=g)[:tokens].to(DEVICE, torch.int32)
    slots[1] = -1
    return qkv, qk, v, (cos, sin), weights, slots


def pools(dtype: torch.dtype, n: int = 2) -> list[torch.Tensor]:
    """Pools filled with a marker, so that a write to a wrong slot (or to a padding one) shows."""
    return [torch.full((PAGES, PAGE, NUM_KV, DIM), 7.0, device=DEVICE).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("pool_dtype", ["same", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_is_rotary_then_store_kv(dtype, pool_dtype):
    qkv, qk, v, (cos, sin), _, slots = step(dtype, 1)
    kv_dtype = dtype if pool_dtype == "same" else torch.float8_e4m3fn
    want_qkv = qkv.clone()
    want_qk = want_qkv[:, : (NUM_Q + NUM_KV) * DIM].view(qk.shape)
    rotary(want_qk, cos, sin, out=want_qk)
    want_k, want_v = pools(kv_dtype)
    store_kv(want_k, want_v, want_qk[:, NUM_Q:], v, slots)

    k_cache, v_cache = pools(kv_dtype)
    out = rotary_store(qk, cos, sin, NUM_Q, KVStore(k_cache, v_cache, slots, v))
    assert out.data_ptr() == qk.data_ptr()  # in place, in the fused qkv rows
    assert torch.equal(qkv, want_qkv)  # q and k rotated, v untouched
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())
    assert not torch.equal(k_cache.float(), pools(kv_dtype, 1)[0].float())  # it did store


@pytest.mark.parametrize("pool_dtype", ["same", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norms_rope_and_store_are_the_three_kernels(dtype, pool_dtype):
    qkv, qk, v, rope, (wq, wk), slots = step(dtype, 2)
    kv_dtype = dtype if pool_dtype == "same" else torch.float8_e4m3fn
    want = qk_rms_norm(qk, wq, wk, 1e-6, NUM_Q, rope=rope)
    want_k, want_v = pools(kv_dtype)
    store_kv(want_k, want_v, want[:, NUM_Q:], v, slots)

    k_cache, v_cache = pools(kv_dtype)
    before = qkv.clone()
    got = qk_rms_norm(qk, wq, wk, 1e-6, NUM_Q, rope=rope, store=KVStore(k_cache, v_cache, slots, v))
    assert torch.equal(got, want) and torch.equal(qkv, before)  # a new tensor; the qkv rows as they were
    assert torch.equal(k_cache.float(), want_k.float()) and torch.equal(v_cache.float(), want_v.float())


def test_bad_stores_are_refused():
    _, qk, v, (cos, sin), _, slots = step(torch.float32, 3)
    k_cache, v_cache = pools(torch.float32)
    with pytest.raises(ValueError, match="one per token"):
        rotary_store(qk, cos, sin, NUM_Q, KVStore(k_cache, v_cache, slots[:2], v))
    with pytest.raises(ValueError, match="k heads"):
        rotary_store(qk, cos, sin, NUM_Q + 1, KVStore(k_cache, v_cache, slots, v))
    with pytest.raises(ValueError, match="contiguous rows"):
        rotary_store(qk.transpose(0, 1).contiguous().transpose(0, 1), cos, sin, NUM_Q,
                     KVStore(k_cache, v_cache, slots, v))


@pytest.mark.parametrize("name, watched", [("llama-3.1-8b", "rotary_store"), ("qwen3-30b-a3b", "qk_rms_norm")])
def test_an_engine_on_the_triton_kernels_stores_kv_in_the_position_launch(name, watched, tmp_path):
    """Prefill and decode at batch 1 (the tiny configs cut from configs/, fp32 dummy weights): the
    torch path's greedy tokens, logprobs within 1e-4, with every layer's k and v stored by the
    position kernel and none by the backend (a missed store would leave the pool's garbage)."""
    want, got, rows = batch_one_on_both_paths(cut_config(name, tmp_path), DEVICE.type, head_position, watched, 5)
    assert rows == [len([5, 9, 11, 40, 2])] * 2 + [1] * (2 * 4)  # 2 layers: the prefill, then 4 decode steps
    assert_same_tokens(want, got)
