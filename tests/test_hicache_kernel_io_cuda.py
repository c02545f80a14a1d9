"""The "kernel" IO backend on CUDA (skipped without a GPU): the pinned pool mapped onto the device
(ketch/cache/host_mapping.py) and the page-copy kernel reading and writing it.

1. map_pinned aliases: bytes written on the host are read by a device kernel, and bytes a device
   kernel writes are read on the host, for a whole pinned tensor and a view inside one (an
   address inside an allocation), fp32/bf16/fp8; the device view keeps the host memory alive;
   pageable memory is refused. The device side is always a kernel (a dtype conversion), never
   a memcpy: kernels are what the backend uses, and a memcpy's kind would be a second question.
2. copy_pages between a device pool and a mapped pinned pool, both directions, bit for bit.
3. Loads and saves through HostPools of each plan (direct runs, host gather, kernel) from the same
   bytes leave identical device and host pools.
4. A kernel-backend host pool compiles its kernels when built: loads and saves compile nothing.
The ordering tests with this backend (held-back copy stream, per-layer waits, saves before
reuse, engine output) are tests/test_hicache_cuda.py's, run with both backends.
"""
from __future__ import annotations

import gc

import pytest
import torch

from ketch.cache import layer_loader
from ketch.cache.host_mapping import map_pinned
from ketch.cache.host_pool import HostPool
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("view", [False, True], ids=["whole", "inside"])
def test_a_mapped_pinned_tensor_aliases_host_memory(dtype: torch.dtype, view: bool) -> None:
    base = torch.empty((10, 4, 16), dtype=dtype, pin_memory=True)
    host = base[3:9] if view else base
    mapped = map_pinned(host, torch.device("cuda"))
    assert mapped.device.type == "cuda" and mapped.dtype == dtype and mapped.shape == host.shape
    host.view(torch.uint8).copy_(_random(host.shape, dtype, 0).view(torch.uint8))  # written on the host
    torch.cuda.synchronize()
    read = mapped.view(torch.uint8).to(torch.int16)  # a device kernel reads host memory
    assert read.device.type == "cuda" and torch.equal(read.cpu(), host.view(torch.uint8).to(torch.int16))
    new = _random(host.shape, dtype, 1).view(torch.uint8)
    mapped.view(torch.uint8).copy_(new.to(torch.int16).cuda())  # a device kernel (int16 -> uint8) writes it
    torch.cuda.synchronize()
    assert torch.equal(host.view(torch.uint8), new)


def test_the_device_view_keeps_the_host_memory_alive() -> None:
    mapped = map_pinned(torch.full((256,), 7.0, pin_memory=True), torch.device("cuda"))
    gc.collect()
    for _ in range(4):  # pinned blocks freed now would be handed out again here
        torch.zeros(256, pin_memory=True)
    assert torch.equal(mapped.to(torch.float64).cpu(), torch.full((256,), 7.0, dtype=torch.float64))


def test_pageable_memory_is_refused() -> None:
    with pytest.raises(ValueError, match="not pinned"):
        map_pinned(torch.zeros(16), torch.device("cuda"))


def test_copy_pages_reads_and_writes_a_mapped_pool() -> None:
    from ketch.kernels.page_copy import copy_pages

    dev = _random((32, 16, 8, 128), torch.bfloat16, 2, "cuda")  # Llama-8B K rows: 32 KiB
    host = torch.empty((24, 16, 8, 128), dtype=torch.bfloat16, pin_memory=True)
    host.view(torch.uint8).copy_(_random(host.shape, torch.bfloat16, 3).view(torch.uint8))
    mapped = map_pinned(host, torch.device("cuda"))
    h_ids, d_ids = [5, 0, 17, 9, 23], [31, 2, 3, 4, 16]
    want_dev = dev.view(torch.uint8).clone()
    want_dev[d_ids] = host.view(torch.uint8)[h_ids].cuda()
    copy_pages(mapped, dev, torch.tensor(h_ids, device="cuda"), torch.tensor(d_ids, device="cuda"))  # a load
    torch.cuda.synchronize()
    assert torch.equal(dev.view(torch.uint8), want_dev)
    src, into = [1, 30, 7], [22, 4, 11]
    want_host = host.view(torch.uint8).clone()
    want_host[into] = dev.view(torch.uint8)[src].cpu()
    copy_pages(dev, mapped, torch.tensor(src, device="cuda"), torch.tensor(into, device="cuda"))  # a save
    torch.cuda.synchronize()
    assert torch.equal(host.view(torch.uint8), want_host)


def _pools_after(plan: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """Save scattered device pages to the host and load them back into other pages, with one plan;
    the bytes of both pools after."""
    monkeypatch.setattr(layer_loader, "DIRECT_MIN_RUN_BYTES", 1 if plan == "direct" else 1 << 60)
    pool = KVPool(KVSpec.mha(4, 2, 64), 64, 16, dtype, "cuda", compute_dtype=torch.bfloat16)
    host = HostPool(pool, 48, io_backend="kernel" if plan == "kernel" else "direct")
    for i, layer in enumerate(pool.layers):
        for j, t in enumerate(layer.values()):
            t.view(torch.uint8).copy_(_random(t.shape, dtype, 10 * i + j, "cuda").view(torch.uint8))
    for layer in host.layers:
        for t in layer.values():
            t.view(torch.uint8).zero_()
    rng = torch.Generator().manual_seed(4)
    saved, host_pages = torch.randperm(64, generator=rng)[:20].tolist(), torch.randperm(48, generator=rng)[:20].tolist()
    host.save(saved, host_pages)
    host.guard_device_reuse()
    host.load(host_pages[::-1], torch.randperm(64, generator=rng)[:20].tolist())
    pool.take_pending_load().wait_all()
    torch.cuda.synchronize()
    monkeypatch.undo()
    return ([{n: t.view(torch.uint8).cpu() for n, t in layer.items()} for layer in pool.layers],
            [{n: t.view(torch.uint8).clone() for n, t in layer.items()} for layer in host.layers])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_every_plan_leaves_the_same_pools(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {plan: _pools_after(plan, dtype, monkeypatch) for plan in ("direct", "gathered", "kernel")}
    dev_ref, host_ref = results["direct"]
    for plan, (dev, host) in results.items():
        for a, b in zip(dev + host, dev_ref + host_ref, strict=True):
            assert all(torch.equal(a[n], b[n]) for n in a), plan


def test_loads_and_saves_compile_nothing_after_init() -> None:
    """The kernel variants are compiled when the host pool is built (KernelIO._warm_up), not by
    the first load or save of a running server."""
    from ketch.kernels import page_copy

    def variants() -> int:
        return sum(len(c[0]) for c in page_copy._copy_pages_kernel.device_caches.values())

    pool = KVPool(KVSpec.mha(2, 2, 64), 32, 16, torch.bfloat16, "cuda")
    host = HostPool(pool, 16, io_backend="kernel")
    before = variants()
    host.save([3, 9, 4], [7, 1, 12])  # scattered: the kernel plan
    host.guard_device_reuse()
    host.load([12, 1], [30, 5])
    pool.take_pending_load().wait_all()
    torch.cuda.synchronize()
    assert variants() == before
