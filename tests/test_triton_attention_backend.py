"""The Triton attention backend against the torch one, end to end over a paged pool (the
kernels' own tests: tests/test_kernels.py): mixed decode / extend steps, many splits, the short
decode shape at one row, bad batches."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest

pytest.importorskip("triton")

from test_kernels import D, DEVICE, DTYPES, H, KVH, close

from ketch.attention.registry import create_attention_backend
from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.attention.triton_backend import TritonAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec
from ketch.forward_batch import ForwardBatch, SeqChunk


def step_inputs(seqs: list[SeqChunk], layers: int, dtype: torch.dtype, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    tokens = sum(s.num_new for s in seqs)
    return [tuple(torch.randn(tokens, n, D, generator=gen).to(DEVICE, dtype) for n in (H, KVH, KVH)) for _ in range(layers)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [{}, {"max_splits": 64, "decode_splits_len": 4096}], ids=["default", "many-splits"])
def test_triton_backend_matches_torch_backend(dtype: torch.dtype, splits: dict) -> None:
    """many-splits: sized for a 4,096-token context (a long-context server's graphs) with up to 64
    splits, past one merge tile: the short sequences here leave most of them empty."""
    gen = torch.Generator().manual_seed(5)
    page_size, layers, num_pages = 8, 2, 48
    pools = [KVPool(KVSpec.mha(layers, KVH, D), num_pages, page_size, dtype, DEVICE) for _ in range(2)]
    for layer in range(layers):  # identical history in both pools
        for t in ("k", "v"):
            getattr(pools[0], t)[layer].copy_(torch.randn(num_pages, page_size, KVH, D, generator=gen))
            getattr(pools[1], t)[layer].copy_(getattr(pools[0], t)[layer])
    ref = TorchAttentionBackend(pools[0], D, DEVICE)
    tri = TritonAttentionBackend(pools[1], H, D, DEVICE, decode_block_n=16, extend_block_m=16, extend_block_n=16,
                                 **splits)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    steps = [
        [  # mixed: decodes (one a 1-token prompt) first, then prefill with prefix, then fresh prefill
            SeqChunk(start=40, num_new=1, page_table=perm[0:6]),
            SeqChunk(start=0, num_new=1, page_table=perm[6:7]),
            SeqChunk(start=9, num_new=1, page_table=perm[7:9]),
            SeqChunk(start=16, num_new=13, page_table=perm[9:14]),
            SeqChunk(start=0, num_new=11, page_table=perm[14:16]),
        ],
        [SeqChunk(start=29, num_new=1, page_table=perm[9:14]), SeqChunk(start=11, num_new=1, page_table=perm[14:16])],
    ]
    for seqs in steps:
        batch = ForwardBatch.build(seqs, page_size)
        ref_meta, tri_meta = ref.init_metadata(batch), tri.init_metadata(batch)
        assert (tri_meta.decode.num_splits > 16) == bool(splits)
        for layer, (q, k, v) in enumerate(step_inputs(seqs, layers, dtype, gen)):
            close(tri.forward(q, k, v, layer, tri_meta), ref.forward(q, k, v, layer, ref_meta), dtype)
    for layer in range(layers):
        assert torch.equal(pools[0].k[layer], pools[1].k[layer]) and torch.equal(pools[0].v[layer], pools[1].v[layer])


def test_short_shape_runs_one_split_a_tile_at_one_short_row_and_matches_torch() -> None:
    """Graphs sized for 4,096 tokens: one decode row within SHORT_SPAN runs one split per 64-row
    tile of the span (not the long shape's MAX_SPLITS, nearly all empty); past the span, or at two
    rows, the long shape. Both equal the torch backend; the graphs of size 1 hold both shapes."""
    from ketch.attention import triton_backend

    gen, page_size, num_pages = torch.Generator().manual_seed(12), 16, 40
    pools = [KVPool(KVSpec.mha(1, KVH, D), num_pages, page_size, torch.float32, DEVICE) for _ in range(2)]
    for t in ("k", "v"):
        getattr(pools[0], t)[0].copy_(torch.randn(num_pages, page_size, KVH, D, generator=gen))
        getattr(pools[1], t)[0].copy_(getattr(pools[0], t)[0])
    ref = TorchAttentionBackend(pools[0], D, DEVICE)
    tri = TritonAttentionBackend(pools[1], H, D, DEVICE, decode_splits_len=4096)
    span = triton_backend.SHORT_SPAN
    short, long = (span // 64, 64), (32, 64)
    assert [tri.decode_shape(1, n) for n in (1, span, span + 1)] == [short, short, long]
    assert tri.decode_shape(2, 5) == long
    assert tri.init_capture([1, 2], max_model_len=4096) == [(1, *short), (1, *long), (2, *long)]
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pages = span // page_size
    for seqs, shape in (([SeqChunk(start=span - 1, num_new=1, page_table=perm[:pages])], short),
                        ([SeqChunk(start=span, num_new=1, page_table=perm[: pages + 1])], long),
                        ([SeqChunk(start=70, num_new=1, page_table=perm[20:25]),
                          SeqChunk(start=3, num_new=1, page_table=perm[25:26])], long)):
        batch = ForwardBatch.build(seqs, page_size)
        meta = tri.init_metadata(batch)
        assert (meta.decode.num_splits, meta.decode.block_n) == shape
        assert tri.graph_key(batch, len(seqs)) == (len(seqs), *shape)
        ((q, k, v),) = step_inputs(seqs, 1, torch.float32, gen)
        close(tri.forward(q, k, v, 0, meta), ref.forward(q, k, v, 0, ref.init_metadata(batch)), torch.float32)


def test_triton_backend_rejects_bad_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = KVPool(KVSpec.mha(1, KVH, D), 4, 4, torch.float32, DEVICE)
    backend = create_attention_backend("triton", pool, H, D, DEVICE)
    assert isinstance(backend, TritonAttentionBackend)
    with pytest.raises(ValueError, match="seqs"):
        backend.init_metadata(ForwardBatch.build([SeqChunk(0, 3, [0]), SeqChunk(4, 1, [1, 2])], 4))
    with pytest.raises(ValueError, match="page_table"):
        backend.init_metadata(ForwardBatch.build([SeqChunk(4, 1, [1])], 4))
    with pytest.raises(ValueError, match="attention_backend"):
        create_attention_backend("flash", pool, H, D, DEVICE)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels cannot take CPU tensors
    with pytest.raises(ValueError, match="CUDA"):
        TritonAttentionBackend(KVPool(KVSpec.mha(1, KVH, D), 4, 4, torch.float32, torch.device("cpu")), H, D, torch.device("cpu"))
