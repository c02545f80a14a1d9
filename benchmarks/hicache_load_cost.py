"""What a host-tier load and save cost on CUDA, by copy plan (ketch/cache/layer_loader.py's
DIRECT_MIN_RUN_BYTES, and the IO backend: `--hicache-io-backend direct|kernel`).

Llama-3.1-8B's KV shape (32 layers, K and V of 8 heads x 128, bf16, 16 tokens a page: 32 KiB
per page per tensor), 512 pages loaded (then saved). For runs of 1, 2, 4, ... pages (contiguous
on both sides) each plan is timed: host time to queue the copy, and the copy stream's time
between its events (what the bandwidth counters read). Plans: "direct" (a DMA per run),
"gathered" (host gather for loads, device gather + DMA per host run for saves: the "direct"
backend's fragmented plan), "kernel/N" (the "kernel" backend's page-copy kernels with at most N
programs a launch, ketch/kernels/page_copy.py's COPY_PROGRAMS). Run on a GPU machine:

    PYTHONPATH=. python benchmarks/hicache_load_cost.py [--programs 16,64,256]
"""
from __future__ import annotations

import argparse
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


def measure(host: HostPool, hp: list[int], dp: list[int], direct: bool, save: bool) -> tuple[float, float]:
    """(host seconds to queue, copy-stream seconds) of one load (save: one save), averaged."""
    layer_loader.DIRECT_MIN_RUN_BYTES = 1 if direct else 1 << 60

    def once() -> None:
        if save:
            host.save(dp, hp)
        else:
            host.load(hp, dp)
            host.device_pool.take_pending_load().wait_all()
    for _ in range(2):  # warm: pinned staging blocks cached, kernels compiled
        once()
    torch.cuda.synchronize()
    stats = host.collect_timings()
    before = stats.save_copy_seconds if save else stats.load_copy_seconds
    reps, t0 = 5, time.perf_counter()
    for _ in range(reps):
        once()
    queued = (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    stats = host.collect_timings()
    return queued, ((stats.save_copy_seconds if save else stats.load_copy_seconds) - before) / reps


def main() -> None:
    from ketch.kernels import page_copy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default=str(page_copy.COPY_PROGRAMS), help="kernel plan: grid caps to try, comma-separated")
    programs = [int(p) for p in ap.parse_args().programs.split(",")]
    pool = KVPool(KVSpec.mha(LAYERS, 8, 128), 4 * PAGES, 16, torch.bfloat16, "cuda")
    host = HostPool(pool, 4 * PAGES)
    kernel_host = HostPool(pool, 4 * PAGES, io_backend="kernel")
    nbytes = PAGES * host.bytes_per_page
    print(f"{PAGES} pages x {host.bytes_per_page / 2**20:.1f} MiB = {nbytes / 2**30:.2f} GiB per load / save")
    print("copy run  plan        queue ms  copy ms  GB/s")
    for save in (False, True):
        for run in (1, 2, 4, 8, 64, PAGES):
            hp, dp = pages_in_runs(run, PAGES, 2 * run), pages_in_runs(run, PAGES, 3 * run)
            plans = [("direct", host, True, None), ("gathered", host, False, None)]
            plans += [(f"kernel/{n}", kernel_host, False, n) for n in programs]
            for name, h, direct, cap in plans:
                if cap is not None:
                    page_copy.COPY_PROGRAMS = cap
                queued, copied = measure(h, hp, dp, direct, save)
                print(f"{'save' if save else 'load'} {run:4d} {name:11s} {queued * 1e3:8.2f} {copied * 1e3:8.2f}"
                      f" {nbytes / copied / 1e9:6.1f}")


if __name__ == "__main__":
    main()
