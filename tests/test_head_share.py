"""ParallelContext.head_share: over every rank, the kv heads are covered exactly once in
contiguous runs as even as possible (each rank at least one), each rank's q heads are exactly
the q heads of its kv heads' groups; an even split is the plain `split`; too few kv heads or
heads that do not group fail naming num_kv_heads. And a QKV layer of an uneven share loads
the rows of its heads (SmolLM2's 9 heads / 3 kv heads over 2 ranks)."""
from __future__ import annotations

import pytest
import torch

from ketch.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
from ketch.parallel import ParallelContext


@pytest.mark.parametrize("heads, kv_heads, world", [(9, 3, 2), (4, 2, 2), (12, 4, 3), (32, 8, 3), (15, 5, 4),
                                                    (8, 8, 8), (6, 3, 3), (14, 7, 2)])
def test_shares_cover_every_head_once(heads, kv_heads, world):
    shares = [ParallelContext(r, world).head_share(heads, kv_heads) for r in range(world)]
    group = heads // kv_heads
    kv_seen, q_seen = [], []
    for s in shares:
        assert s.num_kv >= 1 and s.num_q == s.num_kv * group and s.q_start == s.kv_start * group
        kv_seen += range(s.kv_start, s.kv_start + s.num_kv)
        q_seen += range(s.q_start, s.q_start + s.num_q)
    assert kv_seen == list(range(kv_heads)) and q_seen == list(range(heads))  # in rank order, once each
    sizes = [s.num_kv for s in shares]
    assert max(sizes) - min(sizes) <= 1
    if kv_heads % world == 0:
        assert all(s.num_q == ParallelContext(0, world).split(heads, "num_heads") for s in shares)


def test_shares_that_cannot_be_made_name_num_kv_heads():
    with pytest.raises(ValueError, match="num_kv_heads: 2 kv heads cannot give one to each rank"):
        ParallelContext(0, 3).head_share(6, 2)
    with pytest.raises(ValueError, match="num_kv_heads: 9 heads do not form groups over 2 kv heads"):
        ParallelContext(0, 2).head_share(9, 2)


def test_an_uneven_qkv_and_o_proj_load_their_heads_rows_and_columns():
    hd, hidden, heads, kv_heads = 4, 8, 9, 3
    full = {n: torch.randn(rows * hd, hidden) for n, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    o = torch.randn(hidden, heads * hd)
    for rank, (q_heads, kv_first) in enumerate(((6, 0), (3, 2))):  # rank 0: kv heads 0-1, rank 1: kv head 2
        parallel = ParallelContext(rank, 2)
        qkv = QKVParallelLinear(hidden, hd, heads, kv_heads, parallel=parallel)
        for name in ("q", "k", "v"):
            qkv.weight_loader(qkv.weight, full[name], name)
        q_first = kv_first * 3
        want = torch.cat((full["q"][q_first * hd : (q_first + q_heads) * hd],
                          full["k"][kv_first * hd : (kv_first + q_heads // 3) * hd],
                          full["v"][kv_first * hd : (kv_first + q_heads // 3) * hd]))
        assert torch.equal(qkv.weight.data, want)
        share = qkv.share
        row = RowParallelLinear(heads * hd, hidden, parallel=parallel, part=(share.q_start * hd, share.num_q * hd))
        row.weight_loader(row.weight, o)
        assert torch.equal(row.weight.data, o[:, q_first * hd : (q_first + q_heads) * hd])
