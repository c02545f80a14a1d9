"""What a host-tier load costs on CUDA, by copy plan (ketch/cache/layer_loader.py's DIRECT_MIN_RUN_BYTES).

Llama-3.1-8B's KV shape (32 layers, K and V of 8 heads x 128, bf16, 16 tokens a page: 32 KiB
per page per tensor), 512 pages loaded. For runs of 1, 2, 4, ... pages (contiguous on both
sides) each plan is timed: host time to queue the load, and the copy stream's time between
its events (what the bandwidth counter reads). Run on a GPU machine:

    PYTHONPATH=. python benchmarks/hicache_load_cost.py
"""
from __future__ import annotations

import time

import torch

from ketch.cache import layer_loader
from ketch.cache.host_pool import HostPool
from ketch.cache.kv_pool import KVPool
from ketch.config import KVSpec

PAGES, LAYERS = 512, 32


def pages_in_runs(run: int, total: int, stride: int) -> list[int]:
    """`total` page ids in runs of `run`, each run starting `stride` pages after the last."""
    return [r * stride + i for r in range(total // run) for i in range(run)]


def measure(host: HostPool, hp: list[int], dp: list[int], direct: bool) -> tuple[float, float]:
    layer_loader.DIRECT_MIN_RUN_BYTES = 1 if direct else 1 << 60
    for _ in range(2):  # warm: pinned staging blocks cached, kernels loaded
        host.load(hp, dp)
        host.device_pool.take_pending_load().wait_all()
    torch.cuda.synchronize()
    host.collect_timings()
    before = host.stats.load_copy_seconds
    reps, t0 = 5, time.perf_counter()
    for _ in range(reps):
        host.load(hp, dp)
        host.device_pool.take_pending_load().wait_all()
    queued = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    return queued, (host.collect_timings().load_copy_seconds - before) / reps


def main() -> None:
    pool = KVPool(KVSpec.mha(LAYERS, 8, 128), 4 * PAGES, 16, torch.bfloat16, "cuda")
    host = HostPool(pool, 4 * PAGES)
    nbytes = PAGES * host.bytes_per_page
    print(f"{PAGES} pages x {host.bytes_per_page / 2**20:.1f} MiB = {nbytes / 2**30:.2f} GiB per load")
    print("run  plan      queue ms  copy ms  GB/s")
    for run in (1, 2, 4, 8, 64, PAGES):
        hp, dp = pages_in_runs(run, PAGES, 2 * run), pages_in_runs(run, PAGES, 3 * run)
        for direct in (True, False):
            queued, copied = measure(host, hp, dp, direct)
            print(f"{run:4d} {'direct' if direct else 'gathered':9s} {queued * 1e3:8.2f} {copied * 1e3:8.2f}"
                  f" {nbytes / copied / 1e9:6.1f}")


if __name__ == "__main__":
    main()
