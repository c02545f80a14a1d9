"""The CPU's native decode attention (ketch/native/decode_attention.c) reads bf16 pages in place:
against attention computed in float64 from the same bf16 K/V (one bf16 rounding of the output
apart), and against the torch backend's SDPA over gathered pages, for batches with fragmented,
out-of-order page tables, GQA and sequences of different lengths."""
from __future__ import annotations

import pytest
import torch

from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec
from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.native import build
from ketch.native.decode_attention import available, decode_attention, store_decode_attention

pytestmark = pytest.mark.skipif(build.library_path("decode_attention", "generic") is None, reason="no C compiler")
PAGE, KVH, H, D = 4, 3, 9, 64


def pool_with_random_pages(seed: int, dim: int = D) -> KVPool:
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(KVSpec.mha(1, KVH, dim), 32, PAGE, torch.bfloat16, "cpu")
    for t in pool.layers[0].values():
        t.copy_((torch.randn(t.shape, generator=g) * 2).bfloat16())
    return pool


def reference(q, pool, tables, lens, scale):
    out, dim = [], q.shape[-1]
    for b, (table, n) in enumerate(zip(tables, lens)):
        slots = torch.tensor([table[t // PAGE] * PAGE + t % PAGE for t in range(n)])
        k = pool.k[0].view(-1, KVH, dim)[slots].double().repeat_interleave(H // KVH, 1)  # [n, H, dim]
        v = pool.v[0].view(-1, KVH, dim)[slots].double().repeat_interleave(H // KVH, 1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


TABLES = [[[5, 6, 7]], [[9, 2, 30, 4], [1], [17, 3]], [[0, 1, 2, 3, 4, 5, 6, 7]] * 3]
LENS = [[11], [14, 1, 6], [32, 17, 29]]


def check_against_float64(case: int, dim: int) -> None:
    tables, lens = TABLES[case], LENS[case]
    pool = pool_with_random_pages(case, dim)
    q = torch.randn(len(tables), H, dim, generator=torch.Generator().manual_seed(9)).bfloat16()
    width = max(map(len, tables))
    pages = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    got = decode_attention(q, pool.k[0], pool.v[0], pages, torch.tensor(lens), dim ** -0.5)
    want = reference(q, pool, tables, lens, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6 * want.abs().max()).all()


@pytest.mark.parametrize("case", range(len(TABLES)))
def test_equals_float64_attention_over_the_pages(native_isa, case):
    check_against_float64(case, D)


@pytest.mark.parametrize("dim", [8, 72, 80, 128, 256, 100])
def test_every_head_size(native_isa, dim):
    """The unrolled head sizes (64, 128, 256: AVX2 holds 256's accumulators partly in memory),
    vector loops over sizes that are multiples of 8 (AVX2) or 16 (AVX-512) only, and scalar ones."""
    check_against_float64(2, dim)


@pytest.mark.parametrize("dim", [64, 72, 100, 128])
def test_every_split_of_the_work_gives_each_head_the_same_bits(native_isa, dim):
    """Many sequences per thread: a task is a sequence, all kv heads inside chunks of rows (the
    unrolled head sizes only); fewer: a sequence's GQA group per task (its K rows widened once
    for the group); one sequence on many threads: a head per task. Every head's output is the
    same bits each way (case 2: 8-row blocks, tails, and rows past one chunk)."""
    tables, lens = TABLES[2], LENS[2]
    pool = pool_with_random_pages(2, dim)
    q = torch.randn(len(tables), H, dim, generator=torch.Generator().manual_seed(9)).bfloat16()
    pages = torch.tensor(tables)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 3 sequences >= 2 x 1 thread: a sequence per task
        whole = decode_attention(q, pool.k[0], pool.v[0], pages, torch.tensor(lens), dim ** -0.5)
        torch.set_num_threads(2)  # 3 < 2 x 2, but 3 sequences x 3 kv heads >= 2 x 2: a group per task
        grouped = decode_attention(q, pool.k[0], pool.v[0], pages, torch.tensor(lens), dim ** -0.5)
        torch.set_num_threads(8)  # 1 x 3 < 2 x 8: a head per task
        alone = [decode_attention(q[b:b + 1], pool.k[0], pool.v[0], pages[b:b + 1], torch.tensor(lens[b:b + 1]),
                                  dim ** -0.5) for b in range(len(tables))]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grouped, torch.cat(alone))
    assert torch.equal(whole, grouped)


def test_backend_decode_reads_the_pool_in_place():
    """Through the backend: the new tokens stored, the step's page tables and lengths, float64's
    attention to one output rounding (SDPA over gathered pages is looser on bf16: measured on
    this case, mean relative error 0.0042 against 0.0014, its worst element 0.82 off)."""
    if not available():
        pytest.skip("the backend takes the native decode only with an AVX-512 or AVX2 build")
    pool = pool_with_random_pages(7)
    attn = TorchAttentionBackend(pool, D, torch.device("cpu"))
    assert attn.native_decode is not None
    tables = [[9, 2, 30, 4], [1, 8], [17, 3, 12]]
    lens = [PAGE * len(p) - 2 for p in tables]
    batch = ForwardBatch.build([SeqChunk(n - 1, 1, p) for n, p in zip(lens, tables)], PAGE, [1] * 3, [0, 1, 2])
    meta = attn.init_metadata(batch)
    assert meta.decode_mask is None  # no mask built: the kernel reads the lengths
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, H, D, generator=g).bfloat16()
    k, v = (torch.randn(3, KVH, D, generator=g).bfloat16() for _ in range(2))
    got = attn.forward(q, k, v, 0, meta)
    for b, (table, n) in enumerate(zip(tables, lens)):  # the new token went to its slot
        slot = table[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE
        assert torch.equal(pool.k[0].view(-1, KVH, D)[slot], k[b])
        assert torch.equal(pool.v[0].view(-1, KVH, D)[slot], v[b])
    want = reference(q, pool, tables, lens, D ** -0.5)
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6 * want.abs().max()).all()


def test_store_and_attend_in_one_call_equals_the_store_then_the_attention(native_isa):
    """q, k, v as the model hands them: views whose rows are further apart than their heads (v of
    the fused qkv rows, q and k of the rotated q|k rows: two different row strides). The pools end
    as KVPool.store leaves them and the output is the two-call path's, bit for bit."""
    tables = [[9, 2, 30, 4], [1, 8], [17, 3, 12]]
    lens = torch.tensor([PAGE * len(p) - 2 for p in tables])
    slots = torch.tensor([t[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for t, n in zip(tables, lens.tolist())])
    pages = torch.tensor([t + [0] * (4 - len(t)) for t in tables])
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, (H + 2 * KVH) * D, generator=g).bfloat16()
    qk = torch.randn(3, H + KVH, D, generator=g).bfloat16()
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, (H + KVH) * D :].view(3, KVH, D)
    one, two = pool_with_random_pages(11), pool_with_random_pages(11)
    got = store_decode_attention(q, k, v, slots, one.k[0], one.v[0], pages, lens, D ** -0.5)
    two.store(0, slots, k, v)
    want = decode_attention(q.contiguous(), two.k[0], two.v[0], pages, lens, D ** -0.5)
    assert torch.equal(one.k[0], two.k[0]) and torch.equal(one.v[0], two.v[0])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="store_decode_attention"):
        store_decode_attention(q, k, v, slots[:2], one.k[0], one.v[0], pages, lens, D ** -0.5)


def test_fp32_pools_keep_sdpa():
    pool = KVPool(KVSpec.mha(1, KVH, D), 4, PAGE, torch.float32, "cpu")
    assert TorchAttentionBackend(pool, D, torch.device("cpu")).native_decode is None


def test_only_a_vector_build_is_taken(native_isa):
    """The generic build's scalar loops lose to SDPA: the backend keeps SDPA there."""
    pool = KVPool(KVSpec.mha(1, KVH, D), 4, PAGE, torch.bfloat16, "cpu")
    taken = TorchAttentionBackend(pool, D, torch.device("cpu")).native_decode is not None
    assert taken == (native_isa != "generic")
