"""The load loop of `ketch bench serve`: arrivals, the concurrency cap, and the measured window.

One event loop runs it; with `--num-client-processes N` each process runs it over its share of
the requests (serve_procs.py) and the windows are merged.
"""
from __future__ import annotations

import asyncio
import gc
import math
import random
import time
from dataclasses import dataclass

from tqdm import tqdm

from ketch.bench.datasets import SampleRequest
from ketch.bench.serve_client import RequestConfig, send_request
from ketch.bench.serve_http import HTTPClient
from ketch.bench.serve_metrics import RequestResult


@dataclass
class LoadRun:
    """One event loop's results (in the order of its requests) and its window: perf_counter at the
    first arrival and at the last answer (CLOCK_MONOTONIC on Linux, so windows of processes compare),
    and the CPU seconds the process spent inside it."""

    results: list[RequestResult]
    start: float
    end: float
    cpu_s: float


@dataclass(frozen=True)
class Load:
    max_concurrency: int | None  # None: no cap
    request_rate: float  # requests per second, Poisson; inf: all at once
    seed: int  # the arrival schedule's


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (uvicorn[standard] brings it): a cheaper loop is a higher client ceiling."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - depends on the environment
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def limited(sem: asyncio.Semaphore | None, client: HTTPClient, cfg: RequestConfig,
                  req: SampleRequest) -> RequestResult:
    if sem is None:
        return await send_request(client, cfg, req)
    async with sem:  # the request's clock starts inside: queueing here is the client's, not the server's
        return await send_request(client, cfg, req)


async def run_load(client: HTTPClient, cfg: RequestConfig, requests: list[SampleRequest], load: Load,
                   progress: str | None) -> LoadRun:
    """`progress`: the progress bar's label (None: no bar)."""
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    rng = random.Random(load.seed)
    bar = tqdm(total=len(requests), disable=progress is None, desc=progress)

    async def one(req: SampleRequest) -> RequestResult:
        r = await limited(sem, client, cfg, req)
        bar.update(1)
        return r

    gc.collect()
    gc.freeze()  # what exists now lives through the run: full collections inside it need not walk it
    cpu, start = time.process_time(), time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(load.request_rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(load.request_rate))  # the arrival schedule itself
    results = list(await asyncio.gather(*tasks))
    end, cpu = time.perf_counter(), time.process_time() - cpu
    gc.unfreeze()
    bar.close()
    return LoadRun(results, start, end, cpu)
