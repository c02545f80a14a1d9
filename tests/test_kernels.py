"""Triton kernels vs their torch references, and the Triton attention backend vs the torch one.

Without CUDA the kernels run in Triton's CPU interpreter (set before triton or ketch.kernels is
imported: the jit decorator reads it). The interpreter gets fp32 only (its bf16 is wrong);
bf16 runs when CUDA is present.
"""
import os
import re
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels.activation import silu_and_mul
from ketch.kernels.decode_attention import (
    decode_attention,
    decode_attention_ref,
    num_splits_for,
)
from ketch.kernels.extend_attention import extend_attention, extend_attention_ref
from ketch.kernels.kv_store import store_kv, store_kv_ref
from ketch.kernels.head_position import qk_rms_norm
from ketch.kernels.rmsnorm import add_rms_norm, add_rms_norm_ref, qk_rms_norm_ref, rms_norm, rms_norm_ref
from ketch.kernels.rotary import rotary
from ketch.layers.activation import silu_and_mul as silu_and_mul_ref  # the layer's torch code is the reference
from ketch.layers.rotary import RotaryEmbedding, apply_rotary

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
H, KVH, D = 6, 2, 64  # GQA: 3 q heads per kv head


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The layer's apply_rotary, with the kernel's one cos/sin row per token (a kernel does not
    import layers/, so its reference is wired up here)."""
    tokens, _, head_dim = x.shape
    return apply_rotary(x, cos.reshape(tokens, 1, head_dim), sin.reshape(tokens, 1, head_dim))


def page_tables(lens: list[int], page_size: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint, shuffled pages per sequence (so a wrong page lookup reads someone else's KV),
    padded with page 0 to [batch, max_pages] int32."""
    need = [-(-n // page_size) for n in lens]
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(lens), max(1, max(need)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
    assert used <= num_pages
    return table.to(DEVICE)


def random_pool(num_pages: int, page_size: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_pages, page_size, KVH, D)
    return (torch.randn(shape, generator=gen).to(DEVICE, dtype), torch.randn(shape, generator=gen).to(DEVICE, dtype))


# ---------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_each_slot_and_skips_padding(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    kc, vc = random_pool(6, 5, dtype, gen)
    kr, vr = kc.clone(), vc.clone()
    qkv = torch.randn(7, (H + 2 * KVH) * D, generator=gen).to(DEVICE, dtype)
    k = qkv[:, H * D : (H + KVH) * D].view(7, KVH, D)  # strided views, as the model passes them
    v = qkv[:, (H + KVH) * D :].view(7, KVH, D)
    slots = torch.tensor([0, 29, 13, 4, -1, 7, 12], dtype=torch.int32, device=DEVICE)
    store_kv(kc, vc, k, v, slots)
    store_kv_ref(kr, vr, k, v, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert torch.equal(kc.view(-1, KVH, D)[29], k[1])
    assert torch.equal(vc.view(-1, KVH, D)[12], v[6])


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size,num_splits", [(16, 1), (16, 8), (5, 3)])
def test_decode_attention_matches_reference(dtype: torch.dtype, page_size: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(page_size * 10 + num_splits)
    lens = [1, 7, 200, 33, 0]  # 200 spans every split; 0 is a padded row (zeros, nothing read)
    kc, vc = random_pool(64, page_size, dtype, gen)
    table = page_tables(lens, page_size, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE, dtype)
    out = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, num_splits=num_splits, block_n=16)
    ref = decode_attention_ref(q, kc, vc, table, seq_lens, D**-0.5)
    close(out, ref, dtype)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    # one key: the output is exactly that token's value row
    close(out[0], vc.view(-1, KVH, D)[table[0, 0].long() * page_size].repeat_interleave(H // KVH, 0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_split_writes_the_output_itself_bit_identical_to_its_merge(dtype: torch.dtype,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One split (a large batch, a short context): the split kernel writes the output in q's dtype
    and no merge runs (a scratch of NaN is left untouched); the output equals, bit for bit, the
    merge of that one split (MERGE_ONE_SPLIT, the path before), padded row and one-token row included."""
    from ketch.kernels import decode_attention as module

    gen = torch.Generator().manual_seed(13)
    lens = [1, 7, 200, 0]
    kc, vc = random_pool(64, 16, dtype, gen)
    table = page_tables(lens, 16, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE, dtype)
    scratch = module.decode_scratch(len(lens), H, D, 1, DEVICE)
    for t in scratch:
        t.fill_(float("nan"))
    direct = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, scratch=scratch, num_splits=1, block_n=16)
    assert all(t.isnan().all() for t in scratch)  # never written: the output was
    monkeypatch.setattr(module, "MERGE_ONE_SPLIT", True)
    merged = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, scratch=scratch, num_splits=1, block_n=16)
    assert not scratch[1].isnan().any()  # the merge path did use the scratch
    assert torch.equal(direct, merged)
    close(direct, decode_attention_ref(q, kc, vc, table, seq_lens, D**-0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_more_splits_than_one_merge_tile_read_only_the_nonempty_ones(dtype: torch.dtype) -> None:
    """Past MERGE_BLOCK splits (a long context at a small batch) an empty split writes its lse
    alone and the merge reads the nonempty splits only, MERGE_BLOCK at a time: with the scratch
    full of NaN beforehand, any read of a partial that was never written shows in the output."""
    from ketch.kernels.decode_attention import MERGE_BLOCK, decode_scratch, skips_empty

    splits = 2 * MERGE_BLOCK + 5
    assert skips_empty(splits) and not skips_empty(MERGE_BLOCK)
    gen = torch.Generator().manual_seed(11)
    lens = [1, 7, 600, 33, 0]  # 600: 19 nonempty splits of 32 tokens, past one merge tile; 0: a padded row
    kc, vc = random_pool(64, 16, dtype, gen)
    table = page_tables(lens, 16, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE, dtype)
    mid_o, mid_lse = decode_scratch(len(lens), H, D, splits, DEVICE)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    out = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, scratch=(mid_o, mid_lse), num_splits=splits,
                           block_n=16)
    close(out, decode_attention_ref(q, kc, vc, table, seq_lens, D**-0.5), dtype)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert mid_o[0, :, 1:].isnan().all()  # one token: splits past the first wrote nothing


def test_decode_attention_mha_and_wide_group() -> None:
    gen = torch.Generator().manual_seed(3)
    for heads, kv_heads in ((2, 2), (16, 1)):
        shape = (20, 8, kv_heads, 32)
        kc, vc = torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)
        table = torch.randperm(20, generator=gen)[:18].view(3, 6).to(DEVICE, torch.int32)
        seq_lens = torch.tensor([45, 9, 20], dtype=torch.int32, device=DEVICE)
        q = torch.randn(3, heads, 32, generator=gen).to(DEVICE)
        out = decode_attention(q, kc, vc, table, seq_lens, 0.2, num_splits=2, block_n=16)
        close(out, decode_attention_ref(q, kc, vc, table, seq_lens, 0.2), torch.float32)


def test_num_splits_stays_within_bounds() -> None:
    assert num_splits_for(1, 8, 10) == 1  # too short to split
    assert num_splits_for(1, 8, 100_000, max_splits=16) == 16
    assert num_splits_for(256, 8, 100_000) == 1  # the batch alone fills the GPU
    assert 1 < num_splits_for(4, 8, 4096) <= 16


# ---------------------------------------------------------------- extend


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 5])
def test_extend_attention_matches_reference(dtype: torch.dtype, page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    prefix, new = [0, 20, 33, 0], [5, 40, 17, 1]
    kc, vc = random_pool(64, page_size, dtype, gen)
    table = page_tables([p + n for p, n in zip(prefix, new)], page_size, 64, gen)
    tokens = sum(new)
    q = torch.randn(tokens, H, D, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, KVH, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(tokens, KVH, D, generator=gen).to(DEVICE, dtype)
    ints = {"dtype": torch.int32, "device": DEVICE}
    args = (q, k, v, kc, vc, table, torch.tensor(prefix, **ints), torch.tensor(new, **ints),
            torch.tensor([0, 5, 45, 62], **ints))
    out = extend_attention(*args, max(new), D**-0.5, block_m=16, block_n=16)
    ref = extend_attention_ref(*args, D**-0.5)
    close(out, ref, dtype)
    # the first token of a sequence without a prefix sees only itself
    close(out[0], v[0].repeat_interleave(H // KVH, 0), dtype)


# ---------------------------------------------------------------- norm / rope / silu


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_fused_add_match_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = 96  # not a power of two: masked tail
    x = (torch.randn(5, hidden, generator=gen) * 30).to(DEVICE, dtype)
    residual = (torch.randn(5, hidden, generator=gen) * 20_000).to(DEVICE, dtype)  # SmolLM2-sized stream
    weight = torch.randn(hidden, generator=gen).to(DEVICE, dtype)
    close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)
    out, res = add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(res, ref_res)
    close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_head_norm_matches_two_norms(dtype: torch.dtype) -> None:
    """Qwen3's q / k head norms in one launch, read straight out of the fused qkv rows (a token
    stride wider than the q and k heads): each head with its own weight, as two norms and a cat,
    and the same bits as the rms_norm kernel per head. The torch ops' version is the reference."""
    from ketch.layers.ops import torch_qk_norm

    gen = torch.Generator().manual_seed(3)
    tokens, num_q, num_k, dim = 5, 4, 2, 48  # dim not a power of two: masked tail
    qkv = (torch.randn(tokens, (num_q + 2 * num_k) * dim, generator=gen) * 30).to(DEVICE, dtype)
    qk = qkv[:, : (num_q + num_k) * dim].view(tokens, num_q + num_k, dim)
    wq, wk = (torch.randn(dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    got = qk_rms_norm(qk, wq, wk, 1e-6, num_q)
    assert got.shape == qk.shape and got.is_contiguous()
    close(got, qk_rms_norm_ref(qk, wq, wk, 1e-6, num_q), dtype)
    assert torch.equal(got[:, :num_q], rms_norm(qk[:, :num_q], wq, 1e-6))
    assert torch.equal(got[:, num_q:], rms_norm(qk[:, num_q:], wk, 1e-6))
    assert torch.equal(torch_qk_norm(qk.cpu(), wq.cpu(), wk.cpu(), 1e-6, num_q), qk_rms_norm_ref(qk.cpu(), wq.cpu(), wk.cpu(), 1e-6, num_q))
    assert qk_rms_norm(qk[:0], wq, wk, 1e-6, num_q).shape == (0, num_q + num_k, dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_head_norm_with_rope_is_the_norm_then_the_rotary_kernel(dtype: torch.dtype) -> None:
    """Qwen3's head norms and RoPE in one launch: the same bits as qk_rms_norm, then rotary (its
    partner halves normed from their own loads); a model's (cos, sin) rows at several positions."""
    gen = torch.Generator().manual_seed(4)
    tokens, num_q, num_k, dim = 5, 4, 2, 48
    qkv = (torch.randn(tokens, (num_q + 2 * num_k) * dim, generator=gen) * 30).to(DEVICE, dtype)
    qk = qkv[:, : (num_q + num_k) * dim].view(tokens, num_q + num_k, dim)
    wq, wk = (torch.randn(dim, generator=gen).to(DEVICE, dtype) for _ in range(2))
    cos, sin = RotaryEmbedding(dim, 128, 10000.0, None).to(DEVICE).lookup(torch.tensor([0, 3, 50, 127, 7], device=DEVICE),
                                                                           dtype)
    got = qk_rms_norm(qk, wq, wk, 1e-6, num_q, rope=(cos, sin))
    assert torch.equal(got, rotary(qk_rms_norm(qk, wq, wk, 1e-6, num_q), cos, sin))
    assert not torch.equal(got, qk_rms_norm(qk, wq, wk, 1e-6, num_q))  # it did rotate
    with pytest.raises(ValueError, match="even"):
        qk_rms_norm(qk[..., :47], wq[:47], wk[:47], 1e-6, num_q, rope=(cos[..., :47], sin[..., :47]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_model_layout(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(D, 128, 10000.0, None).to(DEVICE)
    positions = torch.tensor([0, 3, 50, 127, 7], device=DEVICE)
    cos, sin = rope.lookup(positions, dtype)
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : (H + KVH) * D].view(5, H + KVH, D)  # q and k heads together, strided
    out = rotary(qk, cos, sin)
    close(out, rotary_ref(qk, cos, sin), dtype)
    close(out[0], qk[0], dtype)  # position 0 is the identity
    assert not torch.allclose(out[1], qk[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 4, 2 * 200, generator=gen) * 4).to(DEVICE, dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (3, 4, 200)
    close(out, silu_and_mul_ref(gate_up), dtype)


# ---------------------------------------------------------------- compiled for the H200


def test_kernels_compile_for_sm90_without_spills() -> None:
    """The interpreter checks the math; only the compiler (sm_90 target, the ptxas shipped in the
    triton wheel, no GPU needed) sees layout errors and register spills."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ketch.kernels.compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^(\w+)\s+registers\s+\d+\s+spilled (\d+) B  before PDL wait: (.*)$", proc.stdout, re.MULTILINE)
    rows = {name: spill for name, spill, _ in found}
    assert set(rows) == {"store_kv", "decode_split", "decode_split_skip", "decode_split_direct", "decode_merge",
                         "decode_merge_blocks",
                         "extend", "add_rms_norm", "qk_rms_norm",
                         "qk_norm_rope", "qk_norm_rope_store", "rope_store", "rotary",
                         "silu_and_mul", "gemv_m1", "gemv_dot", "gemv_whole", "page_copy"}
    assert all(v == "0" for v in rows.values()), proc.stdout
    # PDL: nothing is stored before griddepcontrol.wait, and only parameters are loaded before it
    # (the norm weight; the gemv's first W tile, its prefetch); extend attention stays non-PDL
    wait = {name: re.fullmatch(r"(\d+) loads / (\d+) stores", w) for name, _, w in found}
    assert wait.pop("extend") is None and wait.pop("page_copy") is None, proc.stdout  # page_copy: copy stream
    assert all(m is not None and m.group(2) == "0" for m in wait.values()), proc.stdout
    loads = {name: int(m.group(1)) for name, m in wait.items() if m is not None}
    assert loads["gemv_m1"] > 0 and loads["gemv_dot"] > 0 and loads["gemv_whole"] > 0, proc.stdout
    # built as the GPU's JIT builds it (a model's N and K are multiples of 16): the whole-row gemv's
    # first W tile (WHOLE_K_TILE bytes of Llama's 4096-wide rows) comes in 16-byte loads, a share a thread
    from ketch.kernels.gemv import WHOLE_K_TILE, whole_row_warps

    assert loads["gemv_whole"] == WHOLE_K_TILE // (16 * 32 * whole_row_warps(4096)), proc.stdout
    assert loads["add_rms_norm"] > 0, proc.stdout
    assert loads["qk_rms_norm"] > 0 and loads["qk_norm_rope"] > 0 and loads["qk_norm_rope_store"] > 0, proc.stdout
    assert all(loads[n] == 0 for n in ("store_kv", "decode_split", "decode_split_skip", "decode_split_direct",
                                       "decode_merge", "rotary", "rope_store", "silu_and_mul")), proc.stdout
    assert loads["decode_merge_blocks"] == 1, proc.stdout  # the row's seq len: the step's host copy
    assert "trigger first" not in proc.stdout  # the default: dependents launch after the loads


# the small kernels with an EARLY_TRIGGER variant (KETCH_PDL_EARLY): at bs1 the attention kernels too
EARLY = {"store_kv", "decode_split", "decode_split_skip", "decode_split_direct", "decode_merge", "decode_merge_blocks", "mla_decode",
         "mla_decode_skip", "add_rms_norm", "qk_rms_norm", "qk_norm_rope", "qk_norm_rope_store", "rope_store", "rotary",
         "silu_and_mul", "mla_prepare", "mla_store_rows", "mla_merge", "mla_merge_blocks", "head_gemv_uk",
         "head_gemv_uv", "head_gemv_uv_merged", "head_gemv_uv_merged_blocks"}


@pytest.mark.parametrize("mla", [False, True])
def test_early_trigger_variants_launch_dependents_before_their_wait(mla: bool) -> None:
    """KETCH_PDL_EARLY's build (compile_check --early): the one-wave kernels call
    griddepcontrol.launch_dependents before griddepcontrol.wait, and still neither store nor load
    anything a step writes before the wait; the weight-streaming kernels keep their late trigger."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "ketch.kernels.compile_check", "--arch", "90", "--early", *(["--mla"] if mla else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^(\w+)\s+registers\s+\d+\s+spilled (\d+) B  before PDL wait: (\d+ loads / (\d+) stores|no wait)"
                       r"(  trigger first)?$", proc.stdout, re.MULTILINE)
    assert found and all(spill == "0" and stores in ("0", "") for _, spill, _, stores, _ in found), proc.stdout
    first = {name for name, _, _, _, flag in found if flag}
    assert first == EARLY & {name for name, *_ in found} and first, proc.stdout
