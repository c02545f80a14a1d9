"""Page copy: rows src[src_pages[i]] → dst[dst_pages[i]] between two pools, in one launch.

The host tier's "kernel" IO backend (ketch/cache/layer_loader.py, host_saver.py): one side is the
pinned host pool seen by the GPU through unified virtual addressing (ketch/cache/host_mapping.py),
so the SMs read (load) or write (save) host memory over PCIe themselves, page row by page row,
with no host gather, no staging and no scatter: the engine thread only enqueues the launches.

Work items are BLOCK-word blocks of rows (pages × blocks per row); at most `COPY_PROGRAMS`
programs take them in turn (a grid-stride loop). The cap is the point: the copies run on the
copy stream beside the step's kernels, and a load waits on PCIe, not on the SMs, so a grid of
one program per block would sit on every SM's warp slots for the whole transfer. A capped grid
takes a few warps per SM and still keeps `COPY_PROGRAMS` × 8 KiB in flight (4 × 16 bytes per
thread), far more than PCIe's latency × bandwidth (~2 us × 55 GB/s ≈ 110 KB).

Rows are moved as the widest words their byte size and both base pointers allow (int64, int32,
else uint8): same bits whatever the element type (fp8, bf16, fp32), and Triton's divisibility
specialization of the row length and base pointers (constant per pool) lets it issue 16-byte
vector accesses. Per-call values are not specialized on (a new value must not compile a variant
mid-run): the work count (`do_not_specialize`), the page lists' alignment (they may be views at
any offset of one uploaded index tensor). Ids are trusted: an id out of range is undefined
(checking it would cost a host sync).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ketch.kernels._common import pow2

# Most words one program moves per row block: 8 KiB of int64 over 4 warps is 4 16-byte accesses
# in flight per thread, what a PCIe read stream needs to hide its latency.
MAX_BLOCK_BYTES = 8192
# Most programs of one launch (the grid-stride loop takes the rest): a few warps per SM of an
# H200's 132, 512 KiB in flight. A first guess, to be measured under load (benchmarks/).
COPY_PROGRAMS = 64


@triton.jit(do_not_specialize=["total"], do_not_specialize_on_alignment=["SrcPages", "DstPages"])
def _copy_pages_kernel(Src, Dst, SrcPages, DstPages, row_words, blocks_per_row, total, BLOCK: tl.constexpr):
    for w in range(tl.program_id(0), total, tl.num_programs(0)):  # work item: (page i, block b)
        i = w // blocks_per_row
        offs = (w % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        s = tl.load(SrcPages + i).to(tl.int64)  # int64: page id x row length passes 2^31 words
        d = tl.load(DstPages + i).to(tl.int64)
        x = tl.load(Src + s * row_words + offs, mask=mask)
        tl.store(Dst + d * row_words + offs, x, mask=mask)


def _rows_as_words(t: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """[rows, row bytes / word size] of `word`, the same memory (t contiguous)."""
    row_elems = math.prod(t.shape[1:])
    return t.view(t.shape[0], row_elems).view(torch.uint8).view(word)


def word_dtype(row_bytes: int, *pointers: int) -> torch.dtype:
    """The widest word that divides a row and every base pointer."""
    for word, size in ((torch.int64, 8), (torch.int32, 4)):
        if row_bytes % size == 0 and all(p % size == 0 for p in pointers):
            return word
    return torch.uint8


def _check(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    if dst.dtype != src.dtype:
        raise ValueError(f"copy_pages: dst has dtype {dst.dtype}, src {src.dtype}: a page row moves as bits")
    if tuple(dst.shape[1:]) != tuple(src.shape[1:]):
        raise ValueError(f"copy_pages: dst rows are {tuple(dst.shape[1:])}, src rows {tuple(src.shape[1:])}")
    for name, t in (("src", src), ("dst", dst)):
        if not t.is_contiguous():
            raise ValueError(f"copy_pages: {name} must be contiguous (rows are addressed as id x row length)")
    for name, p in (("src_pages", src_pages), ("dst_pages", dst_pages)):
        if p.dim() != 1 or p.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"copy_pages: {name} must be a 1-D int32/int64 tensor, got {p.dtype} {tuple(p.shape)}")
        if p.device != dst.device:
            raise ValueError(f"copy_pages: {name} is on {p.device}, the copy runs on {dst.device}")
    if dst_pages.numel() != src_pages.numel():
        raise ValueError(f"copy_pages: dst_pages has {dst_pages.numel()} ids for {src_pages.numel()} src_pages")
    if src.device != dst.device:
        raise ValueError(f"copy_pages: src is on {src.device}, dst on {dst.device} (map a pinned host "
                         f"pool onto the device first: ketch/cache/host_mapping.py)")


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """dst[dst_pages[i]] = src[src_pages[i]] for every i (rows = dim 0, any trailing shape, bit
    copies), on the current stream. src, dst: contiguous, same dtype and row shape, on one device;
    src_pages, dst_pages: 1-D int32/int64 on that device, as many ids each."""
    _check(src, dst, src_pages, dst_pages)
    n = src_pages.numel()
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    if n == 0 or row_bytes == 0:
        return
    word = word_dtype(row_bytes, src.data_ptr(), dst.data_ptr())
    s, d = _rows_as_words(src, word), _rows_as_words(dst, word)
    row_words = s.shape[1]
    block = min(pow2(row_words), MAX_BLOCK_BYTES // s.element_size())
    blocks_per_row = triton.cdiv(row_words, block)
    total = n * blocks_per_row
    _copy_pages_kernel[(min(total, COPY_PROGRAMS),)](
        s, d, src_pages, dst_pages, row_words, blocks_per_row, total,
        BLOCK=block, num_warps=4 if block * s.element_size() >= 2048 else 1)


def copy_pages_ref(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
    """The same copy in torch (the tests' reference)."""
    rows = src.view(torch.uint8).index_select(0, src_pages.long().to(src.device))
    dst.view(torch.uint8).index_copy_(0, dst_pages.long().to(dst.device), rows.to(dst.device))
