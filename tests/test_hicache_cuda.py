"""The host tier's side-stream loader on CUDA (ketch/cache/layer_loader.py; skipped without a GPU).

1. HostPool save, then a side-stream load into other device pages: every byte of every layer
   comes back, for a load copied run by run, a gathered one and one through the page-copy
   kernels (IO backend "kernel": the pinned pool mapped onto the GPU), bf16 and fp8 pages.
2. An engine (tiny random Llama, fp32, Triton, decode graphs) whose device pool is a fraction of
   the working set: greedy output identical with the hierarchy off, host hits counted, the copy
   time measured on the GPU.
3. Each layer waits for its own copies: the copy stream is held back (torch.cuda._sleep before
   every layer's copies) and the device pool is scribbled over before a request whose prefix
   is only on the host runs; its logits equal those of the same run without the delay. The
   same run with the waits taken out reads the scribbles and must differ: the test's teeth.
4. Saves on the copy stream (ketch/cache/host_saver.py), held back by torch.cuda._sleep: the
   device pages are rewritten on the compute stream right after the save, as write_back's
   eviction lets the next step do, behind the eviction's wait (`guard_device_reuse`); the host
   rows are the saved bytes (and without that wait they are not: the planted bug); the L3 writer
   thread encodes the saved bytes although it is handed the pages before the copy ran; the engine
   with write_back and delayed saves answers as with the hierarchy off.
Every ordering test runs with both IO backends ("direct": DMAs and gathers, "kernel": page-copy
kernels): the delays patch the plans of the very loader / saver under test (their plan for a
fragmented list is bound once, at init).
"""
from __future__ import annotations

import pytest
import torch
from conftest import collect, drain, make_tiny_engine
from logit_tap import LogitTap
from test_hicache_l2 import DEVICE_PAGES, PS, multi_turn

from ketch.cache.host_pool import HostPool
from ketch.cache.host_saver import SideStreamSaver
from ketch.cache.kv_pool import KVPool
from ketch.cache.page_codec import decode_page
from ketch.cache.page_format import PageFormat
from ketch.cache.page_hash import chain_hashes
from ketch.cache.storage.file import FileStorage
from ketch.cache.storage_tier import StorageTier
from ketch.cache import layer_loader
from ketch.cache.layer_loader import PendingLoad, SideStreamLoader, copies_directly, page_runs
from ketch.config import KVSpec
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SLEEP_CYCLES = 40_000_000  # per layer, ~20 ms at 2 GHz: far longer than the tiny model's whole step


def _random_bytes(pool: KVPool, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for layer in pool.layers:
        for t in layer.values():
            b = t.view(torch.uint8)
            b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda", generator=g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", ["runs", "scattered"])
@pytest.mark.parametrize("plan", ["direct", "gathered", "kernel"])
def test_save_then_side_stream_load_round_trips_every_byte(dtype: torch.dtype, layout: str, plan: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_loader, "DIRECT_MIN_RUN_BYTES", 1 if plan == "direct" else 1 << 60)
    pool = KVPool(KVSpec.mha(4, 2, 64), 64, 16, dtype, "cuda", compute_dtype=torch.bfloat16)
    host = HostPool(pool, 48, io_backend="kernel" if plan == "kernel" else "direct")
    assert host.loader is not None and host.layers[0]["k"].is_pinned()
    _random_bytes(pool, 0)
    rng = torch.Generator().manual_seed(1)
    saved = torch.randperm(64, generator=rng)[:20].tolist()
    if layout == "runs":  # two runs, contiguous on both sides
        host_pages, targets = list(range(4, 24)), list(range(30, 40)) + list(range(5, 15))
    else:  # mostly runs of one page
        host_pages, targets = torch.randperm(48, generator=rng)[:20].tolist(), torch.randperm(64, generator=rng)[:20].tolist()
    host.save(saved, host_pages)
    want = [{n: t[saved].view(torch.uint8).clone() for n, t in layer.items()} for layer in pool.layers]
    host.guard_device_reuse()  # the pool is rewritten next, as after an eviction: after the save
    _random_bytes(pool, 2)  # on the compute stream: the copy stream must wait for it first
    assert (len(page_runs(host_pages, targets)) == 2) == (layout == "runs")
    assert copies_directly(page_runs(host_pages, targets), 20, host.loader.row_bytes) == (plan == "direct")
    assert (host.loader.kernel_io is not None) == (plan == "kernel")
    host.load(host_pages, targets)
    pending = pool.take_pending_load()
    assert isinstance(pending, PendingLoad) and pool.take_pending_load() is None  # taken once
    pending.wait_all()  # as the runner does before a graph replay
    for layer, rows in zip(pool.layers, want, strict=True):
        for name, t in layer.items():
            assert torch.equal(t[targets].view(torch.uint8), rows[name]), (layout, name)
    torch.cuda.synchronize()
    st = host.collect_timings()
    assert st.loaded_bytes == 20 * host.bytes_per_page and st.load_copy_seconds > 0


def _cuda_engine(path: str, **kw) -> Engine:
    return make_tiny_engine(path, device="cuda", page_size=PS, cuda_graph_max_bs=8, **kw)


@pytest.fixture(scope="module")
def cuda_reference(tiny_config_path: str) -> list[list[int]]:
    """The hierarchy off, on the GPU: every conversation's answers."""
    return multi_turn(_cuda_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048))


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_engine_output_is_identical_with_pages_loaded_on_the_side_stream(tiny_config_path: str, cuda_reference,
                                                                         overlap: bool, policy: str,
                                                                         io_backend: str) -> None:
    eng = _cuda_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, enable_hierarchical_cache=True,
                       hicache_ratio=8.0, overlap_schedule=overlap, hicache_write_policy=policy,
                       hicache_io_backend=io_backend)
    assert eng.allocator.num_pages == DEVICE_PAGES
    assert multi_turn(eng) == cuda_reference
    host = eng.kv.host_pool
    assert host is not None and host.loader is not None and host.saver is not None
    assert eng.kv.hits.host_tokens > 0 and host.stats.loaded_pages > 0 and host.stats.saved_pages > 0
    torch.cuda.synchronize()
    st = eng.kv.host_stats()
    assert st.loaded_bytes > 0 and st.load_copy_seconds > 0 and st.save_copy_seconds > 0


# ---- 3: each layer waits for its own layer's copies -------------------------------------------

def _delay_each_layer(monkeypatch: pytest.MonkeyPatch, loader: SideStreamLoader) -> None:
    """Hold the copy stream back before every layer's copies (they run on it: the loader is
    inside its stream context when it calls a layer's copy), whatever the plan and backend."""
    def slowed(make):
        def plan(*args):
            copy_layer = make(*args)

            def slow(layer: int) -> None:
                torch.cuda._sleep(SLEEP_CYCLES)
                copy_layer(layer)
            return slow
        return plan
    for name in ("_direct", "_fragmented"):  # the loader's own bound plans
        monkeypatch.setattr(loader, name, slowed(getattr(loader, name)))


def _host_hit_run(path: str, new_tokens: int, monkeypatch: pytest.MonkeyPatch, delay: bool,
                  waits: bool = True, io_backend: str = "direct") -> tuple[list[int], list[torch.Tensor], float]:
    """A 40-token prefix cached, pushed to the host, the device pool scribbled over; then the
    prompt again with `new_tokens` past the prefix (1: a decode-graph step; more: an eager
    extend step). Returns its tokens, its logits and the copy stream's seconds."""
    eng = _cuda_engine(path, kv_cache_memory=64 * 2048, enable_hierarchical_cache=True, hicache_ratio=4.0,
                       hicache_io_backend=io_backend)
    prefix = [3 + (i * 7) % 500 for i in range(40)]
    prompt = prefix + [11, 12, 13][:new_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("first", prefix + [9], params)
    drain(eng)
    eng.kv.tree.evict(eng.allocator.num_pages)  # every cached device page goes to the host
    hit = eng.kv.match(prompt[:-1])
    assert hit.tier == "host" and hit.host_tokens == 40 and not hit.pages
    torch.cuda.synchronize()  # the saves of the eviction have landed (the eviction waited for them)
    for layer in eng.runner.pool.layers:
        for t in layer.values():
            t.normal_(0.0, 3.0)  # what a step reads if it does not wait for the load
    if delay:
        _delay_each_layer(monkeypatch, eng.kv.host_pool.loader)
    if not waits:
        monkeypatch.setattr(PendingLoad, "wait_layer", lambda self, layer: None)
        monkeypatch.setattr(PendingLoad, "wait_all", lambda self: None)
    with LogitTap(eng, keep=lambda row: row.float().cpu()) as tap:
        eng.add_request("again", prompt, params)
        outs = drain(eng)
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert eng.kv.hits.host_tokens == 40
    return collect(outs)[("again", 0)]["ids"], tap.rows["again"], eng.kv.host_stats().load_copy_seconds


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("new_tokens", [3, 1], ids=["extend-per-layer-waits", "decode-graph-waits-all"])
def test_each_layer_waits_for_its_own_copies(tiny_config_path: str, monkeypatch: pytest.MonkeyPatch,
                                             new_tokens: int, io_backend: str) -> None:
    ids, logits, _ = _host_hit_run(tiny_config_path, new_tokens, monkeypatch, delay=False, io_backend=io_backend)
    slow_ids, slow_logits, seconds = _host_hit_run(tiny_config_path, new_tokens, monkeypatch, delay=True,
                                                   io_backend=io_backend)
    assert seconds > 0.01  # the copy stream really was held back (2 layers x ~20 ms)
    assert slow_ids == ids
    assert all(torch.equal(a, b) for a, b in zip(slow_logits, logits, strict=True))


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("new_tokens", [3, 1], ids=["extend", "decode-graph"])
def test_without_the_waits_the_step_reads_stale_pages(tiny_config_path: str, monkeypatch: pytest.MonkeyPatch,
                                                      new_tokens: int, io_backend: str) -> None:
    """The planted bug: with the waits gone, the delayed copies land after attention read the
    pool, so the first logits differ; this is what makes the test above able to fail."""
    _, logits, _ = _host_hit_run(tiny_config_path, new_tokens, monkeypatch, delay=False, io_backend=io_backend)
    _, stale, _ = _host_hit_run(tiny_config_path, new_tokens, monkeypatch, delay=True, waits=False,
                                io_backend=io_backend)
    assert not torch.allclose(stale[0], logits[0])


# ---- 4: saves on the copy stream ----------------------------------------------------------------

def _delay_saves(monkeypatch: pytest.MonkeyPatch, saver: SideStreamSaver, cycles: int = SLEEP_CYCLES) -> None:
    """Hold the copy stream back before each save's copies (they run inside its stream context),
    whatever the plan and backend."""
    def slowed(copy):
        def slow(*args) -> None:
            torch.cuda._sleep(cycles)
            copy(*args)
        return slow
    for name in ("_direct", "_fragmented"):  # the saver's own bound plans
        monkeypatch.setattr(saver, name, slowed(getattr(saver, name)))


def _saved_rows_after_reuse(plan: str, layout: str, monkeypatch: pytest.MonkeyPatch, wait: bool) -> bool:
    """Save 20 pages on a delayed copy stream, free them (guard_device_reuse, as an eviction does,
    unless `wait` is False) and rewrite them on the compute stream at once; True when the host rows
    hold the bytes the pages had at the save."""
    monkeypatch.setattr(layer_loader, "DIRECT_MIN_RUN_BYTES", 1 if plan == "direct" else 1 << 60)
    pool = KVPool(KVSpec.mha(4, 2, 64), 64, 16, torch.bfloat16, "cuda")
    host = HostPool(pool, 48, io_backend="kernel" if plan == "kernel" else "direct")
    _random_bytes(pool, 0)
    if layout == "runs":
        saved, host_pages = list(range(10, 30)), host.alloc(20, for_save=True)  # one run on both sides
    else:
        rng = torch.Generator().manual_seed(3)
        saved, host_pages = torch.randperm(64, generator=rng)[:20].tolist(), torch.randperm(48, generator=rng)[:20].tolist()
    want = [{n: t[saved].view(torch.uint8).cpu() for n, t in layer.items()} for layer in pool.layers]
    _delay_saves(monkeypatch, host.saver)
    host.save(saved, host_pages)
    assert host.last_save() is not None  # still in flight: the engine thread did not wait
    if wait:
        host.guard_device_reuse()  # what an eviction does before the pages are freed: waits for the save
        assert host.last_save() is None
    _random_bytes(pool, 1)  # the next step writing the freed pages
    host.saver.log.wait_pages(host_pages)  # as HostPool.alloc before a host-side writer
    assert host.last_save() is None
    monkeypatch.undo()
    return all(torch.equal(h[n][host_pages].view(torch.uint8), rows[n])
               for h, rows in zip(host.layers, want, strict=True) for n in rows)


@pytest.mark.parametrize("layout", ["runs", "scattered"])
@pytest.mark.parametrize("plan", ["direct", "gathered", "kernel"])
def test_a_delayed_save_keeps_the_bytes_of_pages_rewritten_after_it(plan: str, layout: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert _saved_rows_after_reuse(plan, layout, monkeypatch, wait=True)


@pytest.mark.parametrize("plan", ["gathered", "kernel"])
def test_without_the_save_wait_the_next_step_overwrites_what_is_saved(monkeypatch: pytest.MonkeyPatch, plan: str) -> None:
    """The planted bug: the eviction no longer waits for the delayed save, which then copies the
    new bytes; what makes the test above able to fail."""
    assert not _saved_rows_after_reuse(plan, "scattered", monkeypatch, wait=False)


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_the_l3_writer_encodes_what_a_delayed_save_wrote(tmp_path, monkeypatch: pytest.MonkeyPatch, io_backend: str) -> None:
    pool = KVPool(KVSpec.mha(4, 2, 64), 32, 16, torch.bfloat16, "cuda")
    host = HostPool(pool, 16, io_backend=io_backend)
    for layer in host.layers:
        for t in layer.values():
            t.view(torch.uint8).fill_(0xAB)  # what a writer reading too early would encode
    _random_bytes(pool, 5)
    fmt = PageFormat.for_pool(pool, "fp")
    tier = StorageTier(FileStorage(str(tmp_path)), fmt, host)
    device_pages, host_pages = [7, 8, 3], host.alloc(3, for_save=True)
    hashes = chain_hashes(b"", list(range(3 * 16)), 16)
    _delay_saves(monkeypatch, host.saver)
    host.save(device_pages, host_pages)
    tier.save(hashes, host_pages)  # right after, as HiRadixCache._copy_to_host's on_host_copy
    assert host.last_save() is not None  # queued before the copy ran
    assert tier.drain(10.0) and tier.stats.written_pages == 3
    for h, d in zip(hashes, device_pages, strict=True):
        page = decode_page(tier.backend.get(fmt.key(h)), fmt, key=fmt.key(h))
        for dev, got in zip(pool.layers, page.layers, strict=True):
            for n, t in dev.items():
                assert torch.equal(got[n].view(torch.uint8), t[d].cpu().view(torch.uint8)), (d, n)
    tier.close()


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_engine_with_delayed_write_back_saves_is_identical(tiny_config_path: str, cuda_reference,
                                                           monkeypatch: pytest.MonkeyPatch, io_backend: str) -> None:
    """Every save held back ~1 ms while the engine evicts and reuses device pages behind it."""
    eng = _cuda_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, enable_hierarchical_cache=True,
                       hicache_ratio=8.0, hicache_write_policy="write_back", overlap_schedule=True,
                       hicache_io_backend=io_backend)
    _delay_saves(monkeypatch, eng.kv.host_pool.saver, SLEEP_CYCLES // 20)  # before any save: none yet
    assert multi_turn(eng) == cuda_reference
    assert eng.kv.hits.host_tokens > 0 and eng.kv.host_pool.stats.saved_pages > 0
