"""fp8 e4m3 KV pools (scale 1.0: values clamped to [-448, 448], then cast; cast up on every read)
under the Triton kernels (Triton's interpreter on the CPU, compiled on CUDA): the store equals the
torch clamp + cast bit for bit; decode and extend attention over an fp8 pool equal the fp32
reference over the upcast pool; the kernels compile for sm_90 with an fp8 pool; the Triton and
torch attention backends agree over fp8 pools."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from test_kernels import page_tables

from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.attention.triton_backend import TritonAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec
from ketch.kernels.decode_attention import decode_attention, decode_attention_ref
from ketch.kernels.extend_attention import extend_attention, extend_attention_ref
from ketch.kernels.kv_store import store_kv, store_kv_ref
from ketch.kv_dtype import FP8_E4M3_MAX

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, KVH, D = 6, 2, 64  # GQA: 3 q heads per kv head
# fp32 q: the kernels cast each fp8 tile up exactly, so only the summation order differs from
# the reference (as for an fp32 pool: tests/test_kernels.py's tolerance)
TOL = 2e-5


def fp8_reference(x: torch.Tensor) -> torch.Tensor:
    """What an fp8 page should hold for x: clamp to e4m3's finite range, round to nearest even."""
    return x.float().clamp(-448.0, 448.0).to(FP8)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def with_outliers(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Gaussian values, a few of them far beyond ±448 (clamped on store), some tiny (subnormal in e4m3)."""
    x = torch.randn(shape, generator=gen) * scale
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=gen)
    flat[idx[:8]] = torch.tensor([600.0, -600.0, 1e4, -1e4, 448.0, -448.0, 460.0, -470.0])
    flat[idx[8:16]] = torch.randn(8, generator=gen) * 1e-3
    return x


def fp8_pool(num_pages: int, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An fp8 K/V pool written by the store kernel from values with outliers; also the fp32 source."""
    src = with_outliers((2, num_pages * page_size, KVH, D), gen)
    kc = torch.zeros(num_pages, page_size, KVH, D, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = torch.arange(num_pages * page_size, dtype=torch.int32, device=DEVICE)
    store_kv(kc, vc, src[0].to(DEVICE), src[1].to(DEVICE), slots)
    return kc, vc, src


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_into_fp8_pool_is_the_torch_clamp_and_cast(dtype: torch.dtype) -> None:
    """Bit-exact against torch (the store is a conversion, not math, so bf16 K/V is checked in
    the interpreter too). A padded slot (-1) writes nothing."""
    gen = torch.Generator().manual_seed(0)
    tokens = 9
    k = with_outliers((tokens, KVH, D), gen, scale=100.0).to(DEVICE, dtype)  # many values round across binades
    v = with_outliers((tokens, KVH, D), gen).to(DEVICE, dtype)
    slots = torch.tensor([0, 29, 13, 4, -1, 7, 12, 30, 31], dtype=torch.int32, device=DEVICE)
    kc = fp8_reference(torch.randn(8, 4, KVH, D, generator=gen)).to(DEVICE)  # old contents
    vc = fp8_reference(torch.randn(8, 4, KVH, D, generator=gen)).to(DEVICE)
    kr, vr = kc.clone(), vc.clone()
    store_kv(kc, vc, k, v, slots)
    store_kv_ref(kr, vr, k, v, slots)
    assert torch.equal(bits(kc), bits(kr)) and torch.equal(bits(vc), bits(vr))
    flat_k, flat_v = kc.view(-1, KVH, D), vc.view(-1, KVH, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(bits(flat_k[s]), bits(fp8_reference(k[t])))
            assert torch.equal(bits(flat_v[s]), bits(fp8_reference(v[t])))
    assert float(flat_k.float().abs().max()) == FP8_E4M3_MAX == 448.0  # the outliers saturated, no NaN
    assert not flat_k.float().isnan().any()
    # the torch pool's store writes the same bytes
    pool = KVPool(KVSpec.mha(1, KVH, D), 8, 4, FP8, DEVICE, compute_dtype=dtype)
    keep = slots >= 0
    pool.store(0, slots[keep].long(), k[keep], v[keep])
    written = slots[keep].long()
    assert torch.equal(bits(pool.k[0].view(-1, KVH, D)[written]), bits(flat_k[written]))
    assert torch.equal(bits(pool.v[0].view(-1, KVH, D)[written]), bits(flat_v[written]))


@pytest.mark.parametrize("page_size,num_splits", [(16, 1), (16, 4), (5, 3)])
def test_decode_attention_over_fp8_pool_matches_the_upcast_reference(page_size: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(page_size * 10 + num_splits)
    lens = [1, 7, 200, 33, 0]
    kc, vc, src = fp8_pool(64, page_size, gen)
    table = page_tables(lens, page_size, 64, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = (torch.randn(len(lens), H, D, generator=gen) * 0.1).to(DEVICE)  # outlier keys stay finite in the softmax
    out = decode_attention(q, kc, vc, table, seq_lens, D**-0.5, num_splits=num_splits, block_n=16)
    ref = decode_attention_ref(q, kc.float(), vc.float(), table, seq_lens, D**-0.5)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    # the clamp is visible: the unclamped fp32 values give another answer
    shape = kc.shape
    unclamped = decode_attention_ref(q, src[0].view(shape).to(DEVICE), src[1].view(shape).to(DEVICE), table, seq_lens,
                                     D**-0.5)
    assert (out - unclamped).abs().max() > 1.0


@pytest.mark.parametrize("page_size", [16, 5])
def test_extend_attention_over_fp8_prefix_matches_the_upcast_reference(page_size: int) -> None:
    """The cached prefix is read from the fp8 pool; the step's own K/V at full precision."""
    gen = torch.Generator().manual_seed(page_size)
    prefix, new = [0, 20, 33, 0], [5, 40, 17, 1]
    kc, vc, _ = fp8_pool(64, page_size, gen)
    table = page_tables([p + n for p, n in zip(prefix, new)], page_size, 64, gen)
    tokens = sum(new)
    q = (torch.randn(tokens, H, D, generator=gen) * 0.1).to(DEVICE)
    k = with_outliers((tokens, KVH, D), gen).to(DEVICE)  # new tokens: never clamped (never read from the pool)
    v = with_outliers((tokens, KVH, D), gen).to(DEVICE)
    ints = {"dtype": torch.int32, "device": DEVICE}
    meta = (table, torch.tensor(prefix, **ints), torch.tensor(new, **ints), torch.tensor([0, 5, 45, 62], **ints))
    out = extend_attention(q, k, v, kc, vc, *meta, max(new), D**-0.5, block_m=16, block_n=16)
    ref = extend_attention_ref(q, k, v, kc.float(), vc.float(), *meta, D**-0.5)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=TOL)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(H // KVH, 0), atol=TOL, rtol=TOL)


def test_kernels_compile_for_sm90_with_an_fp8_pool() -> None:
    """fp8 loads/stores and their conversions compile for the H200, without spills."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "ketch.kernels.compile_check", "--arch", "90", "--kv-dtype", "fp8e4nv"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("store_kv", "decode_split", "extend"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(name + " "))
        assert "spilled 0 B" in line, proc.stdout


# ---------------------------------------------------------------- backends


def test_triton_and_torch_backends_agree_over_fp8_pools() -> None:
    """Mixed steps (decodes, a prefill after a cached prefix, a fresh prefill) on two fp8 pools:
    the same outputs and byte-identical pools after the stores."""
    gen = torch.Generator().manual_seed(5)
    page_size, layers, num_pages = 8, 2, 48
    pools = [KVPool(KVSpec.mha(layers, KVH, D), num_pages, page_size, FP8, DEVICE, compute_dtype=torch.float32) for _ in range(2)]
    for layer in range(layers):
        for t in ("k", "v"):
            getattr(pools[0], t)[layer].copy_(fp8_reference(with_outliers((num_pages, page_size, KVH, D), gen)))
            getattr(pools[1], t)[layer].copy_(getattr(pools[0], t)[layer])
    ref = TorchAttentionBackend(pools[0], D, DEVICE)
    tri = TritonAttentionBackend(pools[1], H, D, DEVICE, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    steps = [
        [SeqChunk(40, 1, perm[0:6]), SeqChunk(0, 1, perm[6:7]), SeqChunk(9, 1, perm[7:9]),
         SeqChunk(16, 13, perm[9:14]), SeqChunk(0, 11, perm[14:16])],
        [SeqChunk(29, 1, perm[9:14]), SeqChunk(11, 1, perm[14:16])],
    ]
    for seqs in steps:
        batch = ForwardBatch.build(seqs, page_size)
        ref_meta, tri_meta = ref.init_metadata(batch), tri.init_metadata(batch)
        tokens = sum(s.num_new for s in seqs)
        for layer in range(layers):
            q = (torch.randn(tokens, H, D, generator=gen) * 0.1).to(DEVICE)
            k, v = (with_outliers((tokens, KVH, D), gen).to(DEVICE) for _ in range(2))
            out = tri.forward(q, k, v, layer, tri_meta)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, ref.forward(q, k, v, layer, ref_meta), atol=TOL, rtol=TOL)
    for layer in range(layers):
        assert torch.equal(bits(pools[0].k[layer]), bits(pools[1].k[layer]))
        assert torch.equal(bits(pools[0].v[layer]), bits(pools[1].v[layer]))
