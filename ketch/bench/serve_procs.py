"""`--num-client-processes N`: the load split over N client processes, each with its own event
loop, and their per-request records merged as one process would report them.

- Request i goes to process i % N, so each gets a like mix; the concurrency cap C becomes C // N
  per process (one more for the first C % N); a finite request rate r becomes r / N per process,
  each seeding its schedule with seed + i (independent Poisson streams add up to one at rate r).
- A worker (`worker_main`, in a new interpreter) reads its Job from stdin, says it is ready, waits
  for the go byte that the parent sends to all workers at once, runs, and writes back its records
  and its window. Messages are msgspec msgpack, length-prefixed; nothing is pickled.
- The merged window runs from the earliest start to the latest end (perf_counter is
  CLOCK_MONOTONIC on Linux: one clock for every process), so throughput is over the whole
  wall-clock window; TTFT, TPOT and ITL come from the pooled records, in request order.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import IO

import msgspec

from ketch.bench.datasets import SampleRequest
from ketch.bench.serve_client import UNCOUNTED, RequestConfig, make_client
from ketch.bench.serve_load import Load, LoadRun, new_event_loop, run_load
from ketch.bench.serve_metrics import RequestResult

_READY, _GO = b"R", b"G"
# A worker needs nothing from ketch/__init__.py, which imports torch (through SamplingParams): ~3 s a
# process. It starts with a bare `ketch` package object over the same directory instead (~0.5 s).
_WORKER = ("import sys, types; pkg = types.ModuleType('ketch'); pkg.__path__ = [{path!r}]; sys.modules['ketch'] = pkg; "
           "from ketch.bench.serve_procs import worker_main; raise SystemExit(worker_main())")
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


class Job(msgspec.Struct):
    cfg: RequestConfig
    requests: list[SampleRequest]
    load: Load
    progress: str | None  # the progress bar's label; None: no bar


def split(n_requests: int, load: Load, n: int) -> list[tuple[list[int], Load]]:
    """Each process's request indices and load."""
    if n < 1:
        raise ValueError(f"num_client_processes: must be >= 1, got {n}")
    if n > n_requests:
        raise ValueError(f"num_client_processes: {n} is more than the {n_requests} requests")
    cap = load.max_concurrency
    if cap is not None and cap < n:
        raise ValueError(f"num_client_processes: {n} is more than max_concurrency {cap}")
    shares = []
    for i in range(n):
        share_cap = None if cap is None else cap // n + (i < cap % n)
        shares.append((list(range(i, n_requests, n)), Load(share_cap, load.request_rate / n, load.seed + i)))
    return shares


def _send(f: IO[bytes], payload: bytes) -> None:
    f.write(struct.pack("<Q", len(payload)) + payload)
    f.flush()


def _recv(f: IO[bytes]) -> bytes:
    head = f.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("<Q", head)
    payload = f.read(size)
    if len(payload) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return payload


def run_in_processes(cfg: RequestConfig, requests: list[SampleRequest], load: Load, n: int,
                     show_progress: bool) -> tuple[list[RequestResult], float, list[tuple[float, float]]]:
    """Results in the order of `requests`, the merged window's length in seconds, and each
    process's (CPU seconds, own window's seconds)."""
    shares = split(len(requests), load, n)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(LoadRun)
    worker = [sys.executable, "-c", _WORKER.format(path=_PACKAGE_DIR)]
    procs = [subprocess.Popen(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in shares]
    ok = False
    try:
        for i, (p, (idx, share)) in enumerate(zip(procs, shares, strict=True)):
            # only the first process draws a bar: N bars on one terminal would garble each other
            bar = f"requests (process 1 of {n})" if show_progress and i == 0 else None
            _send(p.stdin, enc.encode(Job(cfg, [requests[j] for j in idx], share, bar)))
        for i, p in enumerate(procs):  # every worker loaded and idle before any starts
            if p.stdout.read(1) != _READY:
                raise RuntimeError(f"client process {i} exited before it was ready (code {p.wait()})")
        for p in procs:
            p.stdin.write(_GO)
            p.stdin.flush()
        runs: list[LoadRun] = []
        for i, p in enumerate(procs):
            try:
                runs.append(dec.decode(_recv(p.stdout)))
            except EOFError:
                raise RuntimeError(f"client process {i} exited without its results (code {p.wait()})") from None
        ok = True
    finally:
        for p in procs:
            with contextlib.suppress(OSError):  # a worker that died has broken its pipe
                p.stdin.close()  # a worker still waiting for its go reads EOF and ends
            if not ok:
                p.kill()  # this run has failed: a worker mid-load would only add load to the server
            p.wait()
    return merge([idx for idx, _ in shares], runs)


def merge(indices: list[list[int]], runs: list[LoadRun]
          ) -> tuple[list[RequestResult], float, list[tuple[float, float]]]:
    """Each process's results put back at their requests' indices; the window from the earliest
    first arrival to the latest last answer."""
    results: list[RequestResult | None] = [None] * sum(len(idx) for idx in indices)
    for idx, run in zip(indices, runs, strict=True):
        for j, r in zip(idx, run.results, strict=True):
            results[j] = r
    if any(r is None for r in results):
        raise ValueError("merge: the indices do not cover every request once")
    cpu = [(run.cpu_s, run.end - run.start) for run in runs]
    return results, max(run.end for run in runs) - min(run.start for run in runs), cpu  # type: ignore[return-value]


async def _work(job: Job) -> LoadRun:
    client = make_client(job.cfg.base_url)
    try:
        return await run_load(client, job.cfg, job.requests, job.load, job.progress)
    finally:
        await client.close()


def worker_main() -> int:
    results_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the results pipe
    jobs_in = sys.stdin.buffer
    job = msgspec.msgpack.decode(_recv(jobs_in), type=Job)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.get_loop()  # the loop exists before the window opens
        results_out.write(_READY)
        results_out.flush()
        if jobs_in.read(1) != _GO:
            return 1  # the parent gave up
        run = runner.run(_work(job))
    for r in run.results:
        if r.output_len != UNCOUNTED:
            r.generated_text = ""  # only the parent's count of uncounted outputs needs the text
    _send(results_out, msgspec.msgpack.encode(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main())
