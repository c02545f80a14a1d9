"""The host-tier loader's device-independent parts (ketch/cache/layer_loader.py): the copy plan
(contiguous runs, direct or gathered), the CPU path (plain copies before the step, nothing left
pending for the forward), the copy-time counter on /metrics. The CUDA side stream itself:
tests/test_hicache_cuda.py (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine
from test_hicache_l2 import DEVICE_PAGES, PS, multi_turn, scraped

from ketch.cache.host_pool import HostPool
from ketch.cache.kv_pool import KVPool
from ketch.cache.layer_loader import DIRECT_MIN_RUN_BYTES, copies_directly, page_runs
from ketch.config import KVSpec


@pytest.mark.parametrize("src,dst,runs", [
    ([], [], []),
    ([5], [9], [(5, 9, 1)]),
    ([0, 1, 2, 3], [7, 8, 9, 10], [(0, 7, 4)]),
    ([0, 1, 2, 3], [7, 8, 3, 4], [(0, 7, 2), (2, 3, 2)]),  # the device side breaks the run
    ([4, 5, 9, 10], [0, 1, 2, 3], [(4, 0, 2), (9, 2, 2)]),  # the host side breaks it
    ([3, 2, 1], [0, 1, 2], [(3, 0, 1), (2, 1, 1), (1, 2, 1)]),  # descending: no run
    ([1, 2, 2], [1, 2, 3], [(1, 1, 2), (2, 3, 1)]),
])
def test_page_runs_are_the_maximal_stretches_contiguous_on_both_sides(src, dst, runs) -> None:
    assert page_runs(src, dst) == runs
    # the runs cover the pairs exactly, in order
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == list(zip(src, dst))


def test_page_runs_refuses_unequal_lists() -> None:
    with pytest.raises(ValueError, match="3 source pages for 2"):
        page_runs([1, 2, 3], [1, 2])


def test_long_runs_copy_directly_short_ones_are_gathered() -> None:
    row = 32 << 10  # Llama-8B's K (or V) page: 16 tokens x 8 heads x 128 x bf16
    n = 4 * DIRECT_MIN_RUN_BYTES // row
    assert copies_directly(page_runs(list(range(n)), list(range(100, 100 + n))), n, row)  # one run
    scattered = list(range(0, 2 * n, 2))  # every page its own run
    assert not copies_directly(page_runs(scattered, list(range(n))), n, row)
    halves = list(range(n // 2)) + list(range(n, n + n // 2))  # two runs of 2 MiB each: direct
    assert copies_directly(page_runs(halves, list(range(n))), n, row)
    assert not copies_directly(page_runs(halves, list(range(n))), n, row // 8)  # 256 KiB DMAs


def _pools(device: str = "cpu") -> tuple[KVPool, HostPool]:
    spec = KVSpec.mha(3, 2, 4)
    pool = KVPool(spec, 16, 4, torch.float32, device)
    return pool, HostPool(pool, 12)


def test_cpu_load_copies_at_once_and_leaves_nothing_pending() -> None:
    pool, host = _pools()
    assert host.loader is None
    for layer in pool.layers:
        for t in layer.values():
            t.copy_(torch.randn_like(t))
    want = {(l, n): t[[3, 4, 9]].clone() for l, layer in enumerate(pool.layers) for n, t in layer.items()}
    host.save([3, 4, 9], [7, 2, 3])
    host.load([7, 2, 3], [0, 1, 15])
    assert pool.take_pending_load() is None  # the CPU forward never waits for anything
    for (l, n), rows in want.items():
        assert torch.equal(pool.layers[l][n][[0, 1, 15]], rows)
    st = host.collect_timings()
    assert st.loaded_pages == 3 and st.load_copy_seconds > 0 and st.loaded_seconds >= st.load_copy_seconds


def test_copy_seconds_reach_metrics(tiny_config_path: str) -> None:
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS,
                           enable_hierarchical_cache=True, hicache_ratio=8.0)
    multi_turn(eng)
    host = eng.kv.host_pool
    assert host is not None and host.stats.loaded_pages > 0
    shown = scraped(eng)
    assert shown["ketch_hicache_load_copy_seconds_total"] == host.stats.load_copy_seconds > 0


class RecordedWaits:
    """The pending load's interface as LayerWaitingAttention uses it: the layers waited for, in order."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def wait_layer(self, layer: int) -> None:
        self.layers.append(layer)


def test_the_waiting_attention_waits_for_the_called_layer_mha_and_mla(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step after a host-tier load wraps the backend: both call shapes (MHA's (q, k, v, layer,
    meta) and MLA's (q, latent, layer, meta, w_uk, w_uv, stored=)) wait for their own layer
    first, and an MLA layer whose prepare stores the latents (latent_sink) waits before it."""
    from ketch.attention.idle import IDLE_ATTENTION
    from ketch.attention.mla_backend import MLAAttentionBackend
    from ketch.attention.mla_triton_backend import MLATritonBackend
    from ketch.config import KVTensorSpec
    from ketch.runner.layer_waits import LayerWaitingAttention

    waits = RecordedWaits()
    idle = LayerWaitingAttention(IDLE_ATTENTION, waits)  # type: ignore[arg-type]
    q, w = torch.zeros(0, 4, 8), torch.zeros(4, 6, 16)
    assert idle.forward(q, q, q, 3, None).shape == (0, 4, 8)
    assert idle.forward(q, torch.zeros(0, 24), 5, None, w, w, stored=False).shape == (0, 4, 6)
    assert idle.latent_sink(6, None) is None and waits.layers == [3, 5]  # nothing stored early: no wait
    pool = KVPool(KVSpec(2, (KVTensorSpec("latent", (24,)),)), 4, 4, torch.float32, torch.device("cpu"))
    torch_mla = LayerWaitingAttention(MLAAttentionBackend(pool, "latent", 0.1, torch.device("cpu")), waits)  # type: ignore[arg-type]
    assert torch_mla.latent_sink(1, None) is None and waits.layers == [3, 5]
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the backend on the CPU (no kernel runs here)
    triton_mla = LayerWaitingAttention(MLATritonBackend(pool, "latent", 4, 16, 0.1, torch.device("cpu")), waits)  # type: ignore[arg-type]
    meta = type("Meta", (), {"slots": torch.zeros(1, dtype=torch.int32)})()
    cache, slots = triton_mla.latent_sink(1, meta)
    assert cache is pool.tensor(1, "latent") and slots is meta.slots and waits.layers == [3, 5, 1]
