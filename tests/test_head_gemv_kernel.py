"""MLA decode's per-head products (ketch/kernels/head_gemv.py) against torch's bmm: W_UK as
stored ([heads, nope, rank]) and W_UV transposed ([heads, rank, v] as a view), views of one
kv_b_proj weight as the model passes them, 1 to 8 rows, sizes off the block sizes, written into
a strided output. Without CUDA the kernel runs in Triton's CPU interpreter (fp32, fp16)."""
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels.head_gemv import MAX_ROWS, head_gemv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
HEADS, NOPE, V, RANK = 3, 40, 24, 72  # not multiples of the blocks: every mask is used


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("rank", [RANK, 520])  # 520: W_UV's long-K blocks (256), masked
def test_both_products_equal_the_bmm(dtype, rows, rank):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(HEADS, NOPE + V, rank, generator=g) / 8).to(DEVICE, dtype)  # kv_b_proj, per head
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    q = torch.randn(rows, HEADS, NOPE + 16, generator=g).to(DEVICE, dtype)  # nope | rope rows
    q_lat = head_gemv(q[:, :, :NOPE], w_uk)
    want = torch.bmm(q[:, :, :NOPE].transpose(0, 1).float(), w_uk.float()).transpose(0, 1)
    torch.testing.assert_close(q_lat.float(), want, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    out = torch.full((rows + 2, HEADS, V), 7.0, dtype=dtype, device=DEVICE)
    head_gemv(q_lat, w_uv.transpose(1, 2), out=out[:rows])
    want = torch.bmm(q_lat.transpose(0, 1).float(), w_uv.transpose(1, 2).float()).transpose(0, 1)
    torch.testing.assert_close(out[:rows].float(), want, atol=TOL[dtype] * 8, rtol=TOL[dtype])
    assert (out[rows:] == 7).all()  # rows past the step untouched


def test_shapes_that_do_not_fit_are_refused():
    x = torch.zeros(MAX_ROWS + 1, HEADS, NOPE, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        head_gemv(x, torch.zeros(HEADS, NOPE, RANK, device=DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        head_gemv(x[:1], torch.zeros(HEADS, NOPE + 1, RANK, device=DEVICE))
    assert head_gemv(x[:0], torch.zeros(HEADS, NOPE, RANK, device=DEVICE)).shape == (0, HEADS, RANK)


SPLIT_BLOCK = 16  # the split kernel's tokens per tile, for the count of nonempty splits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("used", [49, 35, 1, 0])
def test_the_merged_form_past_one_merge_tile_reads_only_the_nonempty_splits(dtype, used):
    """More splits than decode_attention.MERGE_BLOCK: the nonempty ones (a prefix, as the split
    kernels leave them, counted from the row's seq len: 16 tokens a split here) merged a tile at
    a time, the partials of the empty ones never read (NaN here: any read shows); the merge
    kernel then the product, and a torch merge, agree; a padded row (length 0) gives zeros."""
    from ketch.kernels.decode_attention import MERGE_BLOCK, merge_splits

    splits = 3 * MERGE_BLOCK + 1
    g = torch.Generator().manual_seed(splits + used)
    rank = 520
    parts = torch.randn(1, HEADS, splits, rank, generator=g).to(DEVICE)
    lse = (torch.randn(1, HEADS, splits, generator=g) * 4).to(DEVICE)
    lse[0, :, used:] = float("-inf")
    parts[0, :, used:] = float("nan")
    seq_lens = torch.tensor([used * SPLIT_BLOCK], dtype=torch.int32, device=DEVICE)  # `used` splits of 16 hold it
    w_uv = (torch.randn(HEADS, V, rank, generator=g) / 8).to(DEVICE, dtype)
    merged = torch.empty(1, HEADS, rank, dtype=dtype, device=DEVICE)
    want = head_gemv(merge_splits(parts, lse, merged, splits, seq_lens, SPLIT_BLOCK), w_uv.transpose(1, 2))
    out = torch.empty(1, HEADS, V, dtype=dtype, device=DEVICE)
    head_gemv(parts, w_uv.transpose(1, 2), out=out, lse=lse, seq_lens=seq_lens, split_block=SPLIT_BLOCK)
    if DEVICE.type == "cpu":
        assert torch.equal(out, want)
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype] * 8, rtol=TOL[dtype])
    weights = torch.softmax(lse[0] * math.log(2), -1).nan_to_num(0.0)  # 2^(lse - m) / sum
    torch_merged = (weights[..., None] * parts[0].nan_to_num(0.0)).sum(1)  # [heads, rank]
    ref = torch.einsum("hr,hvr->hv", torch_merged.to(dtype).float(), w_uv.float())
    torch.testing.assert_close(out[0].float(), ref, atol=TOL[dtype] * 8, rtol=TOL[dtype] * 8)
    if used == 0:
        assert (out == 0).all()  # every split empty: zero rows
    with pytest.raises(ValueError, match="seq_lens"):
        head_gemv(parts, w_uv.transpose(1, 2), out=out, lse=lse)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_the_merged_form_is_the_merge_then_the_product(dtype, splits):
    """At one row W_UV's product takes split-K attention's partials and log-sum-exps (fp32) and
    merges them itself: decode_attention's merge kernel then head_gemv, a split that saw no
    token (lse -inf) and a head whose splits all did (a zero row) included. The same bits in the
    interpreter (the merge's formulas, reduced over the splits as the merge kernel does)."""
    from ketch.kernels.decode_attention import merge_splits

    g = torch.Generator().manual_seed(splits)
    rank = 520  # W_UV's long-K blocks (256), masked
    parts = torch.randn(1, HEADS, splits, rank, generator=g).to(DEVICE)
    lse = (torch.randn(1, HEADS, splits, generator=g) * 4).to(DEVICE)
    if splits > 1:
        lse[0, 0, 1] = float("-inf")
    lse[0, 2] = float("-inf")
    w_uv = (torch.randn(HEADS, V, rank, generator=g) / 8).to(DEVICE, dtype)
    merged = torch.empty(1, HEADS, rank, dtype=dtype, device=DEVICE)
    seq_lens = torch.tensor([splits * SPLIT_BLOCK], dtype=torch.int32, device=DEVICE)
    want = head_gemv(merge_splits(parts, lse, merged, splits, seq_lens, SPLIT_BLOCK), w_uv.transpose(1, 2))
    out = torch.full((3, HEADS, V), 7.0, dtype=dtype, device=DEVICE)
    head_gemv(parts, w_uv.transpose(1, 2), out=out[:1], lse=lse, seq_lens=seq_lens, split_block=SPLIT_BLOCK)
    if DEVICE.type == "cpu":
        assert torch.equal(out[:1], want)
    else:  # compiled, the two kernels may reduce over the splits in other orders
        torch.testing.assert_close(out[:1].float(), want.float(), atol=TOL[dtype] * 8, rtol=TOL[dtype])
    assert (out[0, 2] == 0).all() and (out[1:] == 7).all()
    with pytest.raises(ValueError, match="one row"):
        head_gemv(parts.expand(2, -1, -1, -1), w_uv.transpose(1, 2), out=out[:2], lse=lse.expand(2, -1, -1),
                  seq_lens=seq_lens, split_block=SPLIT_BLOCK)
