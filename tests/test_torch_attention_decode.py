"""The torch attention backend's decode of one sequence on consecutive pages reads them as a view
of the pool instead of gathering them (two copies per layer fewer at batch 1): the same output,
bit for bit, as the gathered path over the same K/V; chosen only for one decoding sequence whose
pages really are consecutive."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ketch.attention.torch_backend import TorchAttentionBackend
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec
from ketch.forward_batch import ForwardBatch, SeqChunk

PAGE, KVH, H, D = 4, 2, 4, 16


def step(pages: list[list[int]], dtype: torch.dtype = torch.float32, view: bool = True):
    """One decode step of len(pages) sequences, each two tokens short of filling its pages (its last
    token new), over seeded random K/V; view=False turns the consecutive-pages view off (the gathered path). (output, metadata)"""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(KVSpec.mha(1, KVH, D), 16, PAGE, dtype, "cpu")
    for t in pool.layers[0].values():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    attn = TorchAttentionBackend(pool, D, torch.device("cpu"))
    batch = ForwardBatch.build([SeqChunk(PAGE * len(p) - 3, 1, p) for p in pages], PAGE, [1] * len(pages), list(range(len(pages))))
    meta = attn.init_metadata(batch)
    if not view:
        meta = dataclasses.replace(meta, decode_first_page=None)
    q = torch.randn(len(pages), H, D, generator=g).to(dtype)
    k, v = (torch.randn(len(pages), KVH, D, generator=g).to(dtype) for _ in range(2))
    return attn.forward(q, k, v, 0, meta), meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_sequence_on_consecutive_pages_reads_a_view_with_the_gathered_output(dtype):
    out, meta = step([[5, 6, 7]], dtype)
    assert meta.decode_first_page == 5
    gathered, _ = step([[5, 6, 7]], dtype, view=False)
    assert torch.equal(out, gathered)


def test_the_view_is_taken_only_for_one_sequence_on_consecutive_pages():
    assert step([[5, 7, 6]])[1].decode_first_page is None  # out of order
    assert step([[5, 6, 8]])[1].decode_first_page is None  # a gap
    assert step([[5, 6, 7], [8, 9, 10]])[1].decode_first_page is None  # two sequences
    assert step([[3]])[1].decode_first_page == 3  # one page
