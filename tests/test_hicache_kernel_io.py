"""The host tier's "kernel" IO backend, its device-independent parts (ketch/cache/kernel_io.py,
host_mapping.py): the load and save plans' page-copy kernels move exactly the rows the reference
copies move (on the CPU: Triton's interpreter, the host layers used unmapped), and the mapping
refuses what the GPU cannot address. The mapping itself and the CUDA plans against the direct
ones: tests/test_hicache_kernel_io_cuda.py (skipped without a GPU)."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.cache.host_mapping import map_pinned
from ketch.cache.host_pool import HostPool
from ketch.cache.kernel_io import KernelIO
from ketch.cache.kv_pool import KVPool
from ketch.cache.layer_loader import SideStreamLoader
from ketch.config import KVSpec


def _random_bytes(layers: list[dict[str, torch.Tensor]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in layers:
        for t in layer.values():
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def _bytes(layers: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{n: t.view(torch.uint8).clone() for n, t in layer.items()} for layer in layers]


@pytest.fixture(params=[torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def pools(request: pytest.FixtureRequest) -> tuple[KVPool, HostPool]:
    pool = KVPool(KVSpec.mha(3, 2, 8), 24, 4, request.param, "cpu", compute_dtype=torch.float32)
    host = HostPool(pool, 20)
    _random_bytes(pool.layers, 0)
    _random_bytes(host.layers, 1)
    return pool, host


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU pools go through Triton's interpreter, off on a GPU "
                    "machine; the CUDA plans are tests/test_hicache_kernel_io_cuda.py's")
def test_kernel_load_and_save_move_the_listed_rows(pools: tuple[KVPool, HostPool]) -> None:
    pool, host = pools
    io = KernelIO(host.layers, pool.layers, pool.layers[0]["k"].device)
    assert io.host_layers is host.layers  # the CPU: nothing to map
    gen = torch.Generator().manual_seed(2)
    host_pages, dev_pages = torch.randperm(20, generator=gen)[:7].tolist(), torch.randperm(24, generator=gen)[:7].tolist()
    want_dev, want_host = _bytes(pool.layers), _bytes(host.layers)
    for layer in range(3):
        for name in ("k", "v"):
            want_dev[layer][name][dev_pages] = want_host[layer][name][host_pages]
    h_idx, d_idx = io.page_ids(host_pages, dev_pages)
    assert h_idx.tolist() == host_pages and d_idx.tolist() == dev_pages and h_idx.dtype == torch.int32
    for layer in range(3):
        io.load_layer(layer, h_idx, d_idx)
    got = _bytes(pool.layers)
    assert all(torch.equal(got[i][n], want_dev[i][n]) for i in range(3) for n in ("k", "v"))

    _random_bytes(pool.layers, 3)  # new device rows; save some into other host pages
    saved, into = torch.randperm(24, generator=gen)[:5].tolist(), torch.randperm(20, generator=gen)[:5].tolist()
    want_host, dev_now = _bytes(host.layers), _bytes(pool.layers)
    for layer in range(3):
        for name in ("k", "v"):
            want_host[layer][name][into] = dev_now[layer][name][saved]
    d_idx, h_idx = io.page_ids(saved, into)
    for layer in range(3):
        io.save_layer(layer, d_idx, h_idx)
    got = _bytes(host.layers)
    assert all(torch.equal(got[i][n], want_host[i][n]) for i in range(3) for n in ("k", "v"))
    assert all(torch.equal(t.view(torch.uint8), dev_now[i][n]) for i, layer in enumerate(pool.layers)
               for n, t in layer.items())  # a save leaves the device rows alone


def test_an_unknown_io_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^hicache_io_backend must be direct\|kernel, got 'dma'"):
        SideStreamLoader([], [], torch.device("cpu"), io_backend="dma")


@pytest.mark.parametrize("tensor,message", [
    (lambda: torch.zeros(4, 8), "not pinned"),
    (lambda: torch.zeros(8, 4).t(), "contiguous"),
    (lambda: torch.zeros(0, 4), "non-empty"),
])
def test_only_pinned_contiguous_host_memory_maps(tensor, message: str) -> None:
    with pytest.raises(ValueError, match=f"map_pinned: .*{message}"):
        map_pinned(tensor(), torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_mapping_targets_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="device must be a CUDA device"):
        map_pinned(torch.zeros(4, pin_memory=True), torch.device("cpu"))
