"""kernels/decode_position.py: at a decode-only step the decode attention launch takes the raw
q | k | v rows, puts q and the new k in position (Qwen3's head norms and RoPE, or RoPE alone) and
stores the new k and v itself; the pool and the output are the bits of head_position's launch then
decode attention (in the interpreter; natively within rounding of another reduction layout). And
end to end: Llama / Qwen3 engines at batch 1 with KETCH_DECODE_POSITION keep the torch tokens
and run no head_position launch at their decode steps."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from engine_cut import assert_same_tokens, batch_one_on_both_paths, cut_config  # noqa: E402

from ketch.kernels import decode_attention as da  # noqa: E402
from ketch.kernels import head_position  # noqa: E402
from ketch.kernels.decode_attention import decode_attention  # noqa: E402
from ketch.kernels.decode_position import DecodePosition  # noqa: E402
from ketch.kernels.head_position import KVStore, qk_rms_norm, rotary_store  # noqa: E402
from ketch.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
H, KVH, D, PAGE, PAGES = 6, 2, 48, 4, 40  # 3 q heads a kv head; dim not a power of two
LENS = [1, 0, 37, 64, 9]  # a one-token sequence; a padded row (length 0, slot -1)


def step(seed: int):
    g = torch.Generator().manual_seed(seed)
    b = len(LENS)
    qkv = (torch.randn(b, (H + 2 * KVH) * D, generator=g) * 30).to(DEVICE, DTYPE)
    qk = qkv[:, : (H + KVH) * D].view(b, H + KVH, D)
    v = qkv[:, (H + KVH) * D :].view(b, KVH, D)
    perm = torch.randperm(PAGES, generator=g)
    table = torch.zeros(b, 16, dtype=torch.int32)
    used = 0
    for i, n in enumerate(LENS):
        need = -(-n // PAGE)
        table[i, :need] = perm[used : used + need]
        used += need
    slots = torch.tensor([int(table[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE if n else -1
                          for i, n in enumerate(LENS)], dtype=torch.int32)
    positions = torch.tensor([max(n - 1, 0) for n in LENS])
    cos, sin = RotaryEmbedding(D, 128, 10000.0, None).lookup(positions, torch.float32)
    norm = tuple(torch.randn(D, generator=g).to(DEVICE, DTYPE) for _ in range(2))
    history = [(torch.randn(PAGES, PAGE, KVH, D, generator=g) * 3).to(DEVICE, DTYPE) for _ in range(2)]
    return (qk, v, table.to(DEVICE), torch.tensor(LENS, dtype=torch.int32, device=DEVICE), slots.to(DEVICE),
            (cos.to(DEVICE, DTYPE), sin.to(DEVICE, DTYPE)), norm, history)


@pytest.mark.parametrize("norm", [True, False])  # Qwen3 / Llama
@pytest.mark.parametrize("splits,fused_merge", [(1, False), (3, False), (3, True), (8, True)])
@pytest.mark.parametrize("pool_dtype", ["same", "fp8"])
def test_the_launch_positions_and_stores_as_the_two_launches(norm, splits, fused_merge, pool_dtype):
    qk, v, table, lens, slots, (cos, sin), weights, history = step(splits + 10 * norm)
    kv_dtype = DTYPE if pool_dtype == "same" else torch.float8_e4m3fn
    want_k, want_v = (h.clone().to(kv_dtype) for h in history)
    got_k, got_v = (h.clone().to(kv_dtype) for h in history)
    store = KVStore(want_k, want_v, slots, v)
    if norm:
        q_pos = qk_rms_norm(qk, *weights, 1e-6, H, rope=(cos, sin), store=store)[:, :H]
    else:
        q_pos = rotary_store(qk.clone(), cos, sin, H, store)[:, :H]
    want = decode_attention(q_pos, want_k, want_v, table, lens, D**-0.5, num_splits=splits, block_n=16,
                            fused_merge=fused_merge)
    position = DecodePosition(qk[:, H:], v, cos, sin, slots, (*weights, 1e-6) if norm else None)
    got = decode_attention(qk[:, :H], got_k, got_v, table, lens, D**-0.5, num_splits=splits, block_n=16,
                           fused_merge=fused_merge, position=position)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))  # every slot, the new rows included
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert not torch.equal(got_k.view(torch.uint8), history[0].to(kv_dtype).view(torch.uint8))  # rows were stored
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
    else:  # the head norm's sum of squares in another layout
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # the padded row


def test_what_does_not_fit_is_refused():
    qk, v, table, lens, slots, (cos, sin), _, history = step(0)
    for bad in (DecodePosition(qk[:, H:][:, :1], v, cos, sin, slots),
                DecodePosition(qk[:, H:], v, cos, sin, slots[:2])):
        with pytest.raises(ValueError, match="position"):
            decode_attention(qk[:, :H], *history, table, lens, 0.1, position=bad)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_a_batch_one_engine_positioning_in_the_attention_launch_keeps_the_torch_tokens(name, tmp_path, monkeypatch):
    """KETCH_DECODE_POSITION: each layer's decode step runs no head_position launch (the prefill
    still does), and the greedy tokens and logprobs stay the torch path's."""
    monkeypatch.setattr(da, "POSITION", True)
    want, got, rows = batch_one_on_both_paths(cut_config(name, tmp_path), DEVICE.type, head_position, "_launch", 5)
    assert rows == [len([5, 9, 11, 40, 2])] * 2  # the prefill's 2 layers only
    assert_same_tokens(want, got)


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_a_speculating_engine_keeps_storing_before_attention(algorithm, tmp_path, monkeypatch):
    """A verify runs k + 1 decode rows of one sequence, each reading the rows before it, and so
    does a draft model's catch-up: both backends are told so at init (expect_verify_rows) and
    keep the store in the layer's launch, so greedy speculation with KETCH_DECODE_POSITION keeps
    the torch tokens."""
    from conftest import greedy_ids_and_logprobs, make_tiny_engine
    monkeypatch.setattr(da, "POSITION", True)
    path = cut_config("llama-3.1-8b", tmp_path)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9]  # repeats: the ngram proposer drafts
    draft = {"speculative_draft_model_path": path} if algorithm == "draft" else {}
    runs = []
    for kernels in ("torch", "triton"):
        engine = make_tiny_engine(path, device=DEVICE.type, attention_backend=kernels, layer_kernels=kernels,
                                  cuda_graph=False, speculative_algorithm=algorithm, speculative_num_draft_tokens=3,
                                  speculative_adaptive=False, **draft)
        if kernels == "triton":
            assert engine.runner.attn.verify_rows
            if draft:
                assert engine.spec.proposer.runner.attn.verify_rows
        runs.append(greedy_ids_and_logprobs(engine, [prompt], 8))
        engine.check_invariants()
    assert_same_tokens(*runs)
