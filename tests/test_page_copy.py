"""The page copy kernel (ketch/kernels/page_copy.py) against index_select / index_copy_.

Without CUDA the kernel runs in Triton's CPU interpreter on CPU tensors (set before triton is
imported); with CUDA on device tensors. Every comparison is on bytes (`view(torch.uint8)`), so
fp8 and the word views are checked bit for bit. The host-mapped side (pinned pool seen by the
GPU) is tests/test_page_copy_cuda.py.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels import page_copy
from ketch.kernels.page_copy import copy_pages, copy_pages_ref, word_dtype

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# (dtype, row shape): row bytes 256 (int64 words), 36 (int32), 30 and 7 (uint8), 24000 (int64,
# 3 blocks of one row, the last one masked)
CASES = [
    (torch.float32, (4, 2, 8)),
    (torch.float32, (3, 3)),
    (torch.float16, (3, 5)),
    (torch.float8_e4m3fn, (7,)),
    (torch.float8_e4m3fn, (2, 8, 16)),
    (torch.uint8, (24000,)),
]


def random_rows(rows: int, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bits (any dtype, fp8 included), so a wrong word or byte shows."""
    nbytes = rows * int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size()
    b = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return b.view(dtype).view(rows, *shape).to(DEVICE)


def check_copy(src: torch.Tensor, dst: torch.Tensor, sp: list[int], dp: list[int], idx: torch.dtype = torch.int64) -> None:
    want = dst.clone()
    copy_pages_ref(src, want, torch.tensor(sp), torch.tensor(dp))
    copy_pages(src, dst, torch.tensor(sp, dtype=idx, device=DEVICE), torch.tensor(dp, dtype=idx, device=DEVICE))
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype,shape", CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_copies_the_listed_rows_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...], idx: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    src, dst = random_rows(12, shape, dtype, gen), random_rows(9, shape, dtype, gen)
    sp = torch.randperm(12, generator=gen)[:6].tolist()  # scattered on both sides
    dp = torch.randperm(9, generator=gen)[:6].tolist()
    check_copy(src, dst, sp, dp, idx)


def test_repeated_calls_with_other_lists_and_counts() -> None:
    """The same pools, lists of every length (runs, scattered, one page), one after the other:
    each call copies only its own rows."""
    gen = torch.Generator().manual_seed(1)
    src, dst = random_rows(40, (4, 2, 8), torch.float16, gen), random_rows(30, (4, 2, 8), torch.float16, gen)
    for n in (1, 5, 17, 30):
        sp = torch.randperm(40, generator=gen)[:n].tolist()
        dp = torch.randperm(30, generator=gen)[:n].tolist()
        check_copy(src, dst, sp, dp)
    check_copy(src, dst, list(range(3, 13)), list(range(20, 30)))  # one run


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_fewer_programs_than_blocks_take_them_in_turn(programs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid is capped (COPY_PROGRAMS): each program strides over (page, block) items, here
    rows of 3 blocks, so a program's items span pages and blocks."""
    monkeypatch.setattr(page_copy, "COPY_PROGRAMS", programs)
    gen = torch.Generator().manual_seed(5)
    src, dst = random_rows(10, (24000,), torch.uint8, gen), random_rows(12, (24000,), torch.uint8, gen)
    check_copy(src, dst, [9, 2, 4, 0, 7], [11, 0, 5, 3, 6])


def test_page_lists_may_be_views_at_any_offset() -> None:
    """The loaders upload host and device ids as one tensor and pass its two halves: the second
    starts at an offset of n ids, any alignment."""
    gen = torch.Generator().manual_seed(2)
    src, dst = random_rows(16, (8, 8), torch.float32, gen), random_rows(16, (8, 8), torch.float32, gen)
    for n in (3, 4, 7):
        sp, dp = torch.randperm(16, generator=gen)[:n], torch.randperm(16, generator=gen)[:n]
        ids = torch.cat([torch.tensor([99]), sp, dp]).to(torch.int32).to(DEVICE)  # an odd start, too
        want = dst.clone()
        copy_pages_ref(src, want, sp, dp)
        copy_pages(src, dst, ids[1:n + 1], ids[n + 1:])
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))  # random bits: NaNs


def test_a_misaligned_pool_falls_back_to_bytes() -> None:
    """Rows of 64 bytes whose base is 1 byte off: int words would be misaligned, bytes are not."""
    gen = torch.Generator().manual_seed(3)
    base = random_rows(1, (8 * 64 + 1,), torch.uint8, gen)[0]
    src = base[1:].view(8, 64)
    assert word_dtype(64, src.data_ptr()) == torch.uint8
    dst = random_rows(8, (64,), torch.uint8, gen)
    check_copy(src, dst, [7, 0, 3], [1, 2, 6])


def test_word_choice() -> None:
    assert word_dtype(256, 0, 4096) == torch.int64
    assert word_dtype(36, 0, 4096) == torch.int32
    assert word_dtype(256, 0, 4100) == torch.int32  # a base 4-aligned only
    assert word_dtype(30, 0, 0) == torch.uint8


def test_nothing_to_copy_is_a_no_op() -> None:
    src = torch.ones(3, 4, device=DEVICE)
    dst = torch.zeros(3, 4, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    copy_pages(src, dst, empty, empty)
    assert not dst.any()


@pytest.mark.parametrize("change,arg", [
    (dict(dst=torch.zeros(4, 8, dtype=torch.float16)), "dst"),
    (dict(dst=torch.zeros(4, 9)), "dst"),
    (dict(src=torch.zeros(8, 4).t()), "src"),
    (dict(dst_pages=torch.tensor([0])), "dst_pages"),
    (dict(src_pages=torch.tensor([0.0, 1.0])), "src_pages"),
    (dict(src_pages=torch.tensor([[0, 1]])), "src_pages"),
])
def test_bad_arguments_are_named(change: dict, arg: str) -> None:
    args = dict(src=torch.zeros(4, 8), dst=torch.zeros(4, 8), src_pages=torch.tensor([0, 1]), dst_pages=torch.tensor([2, 3]))
    args.update(change)
    args = {k: v.to(DEVICE) for k, v in args.items()}
    with pytest.raises(ValueError, match=f"copy_pages: {arg} "):
        copy_pages(**args)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="compiled variants exist on the GPU only")
def test_new_counts_and_offsets_compile_nothing() -> None:
    gen = torch.Generator().manual_seed(4)
    src, dst = random_rows(64, (16, 8, 64), torch.bfloat16, gen), random_rows(64, (16, 8, 64), torch.bfloat16, gen)
    ids = torch.randperm(64, generator=gen).to(torch.int32).to(DEVICE)
    copy_pages(src, dst, ids[:5], ids[5:10])
    variants = sum(len(c[0]) for c in page_copy._copy_pages_kernel.device_caches.values())
    for n in (1, 3, 8, 31):
        copy_pages(src, dst, ids[:n], ids[n:2 * n])
    assert sum(len(c[0]) for c in page_copy._copy_pages_kernel.device_caches.values()) == variants


def test_rows_move_as_16_byte_vectors_on_sm90() -> None:
    """A long row of int64 words (divisible by 16, aligned bases: what the JIT infers for a pool)
    compiles to 16-byte global loads and stores (the compile check's launch settings)."""
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton build has no NVIDIA backend")
    script = ("import re\nfrom ketch.kernels.compile_check import _compile\n"
              "from ketch.kernels.page_copy import MAX_BLOCK_BYTES, _copy_pages_kernel as fn\n"
              "sig = dict(Src='*i64', Dst='*i64', SrcPages='*i32', DstPages='*i32', row_words='i32',\n"
              "           blocks_per_row='i32', total='i32')\n"
              "k = _compile(fn, sig, {'BLOCK': MAX_BLOCK_BYTES // 8}, 90, 4, 3)\n"
              "print(sorted(set(re.findall(r'\\b(?:ld|st)\\.global[.\\w]*', k.asm['ptx']))))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ld.global.v2.b64" in proc.stdout and "st.global.v2.b64" in proc.stdout, proc.stdout
