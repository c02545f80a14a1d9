"""KV transfer throughput of each PD transport backend (issue 17): GB/s per backend x page size.

Two real OS processes on loopback (multiprocessing spawn): a prefill side holding a source pool
and a decode side holding a destination pool, each a list of layer dicts {"k", "v"} of tensors
[num_pages, page_size, heads, head_dim] (the shape of `KVPool.layers`, which is what
`make_transport(config, layers, model)` takes). Per room the decode side registers and posts its
pages, the prefill side waits until it is WaitingForInput (the decode side registered), then
times from `send()` to Success on both sides (the later of the two; CLOCK_MONOTONIC is one clock
for every process of the machine). Every room moves the whole pool, in a page order that differs
from room to room (src pages rotated, dst pages reversed), into a destination zeroed beforehand;
after the room the decode side's per-page checksums (position-weighted int64 sums of every page's
bytes, across layers and K/V) must equal the prefill side's of the pages it sent, in order: a room whose bytes
did not all arrive where they should counts as FAILED, not as a figure.

Definitions (printed with the table):
  page bytes = the bytes of one page id across all layers and both K and V (what one entry of
               `send(src_pages)` moves); one layer tensor's page row is page bytes / (2 x layers).
  GB/s       = 1e9 bytes per second of room bytes (pages x page bytes) over send() -> both Success.
Reference (one process, same bytes): `copy_` of each whole layer tensor (a memcpy) and
`index_copy_` of the page rows in the rooms' page order (what the tcp receiver does per chunk).

Backends: `--backends tcp,nixl,fake` (any name `make_transport` knows, e.g. mooncake once it
exists). nixl runs when the package imports, with UCX_TLS=tcp unless UCX_TLS is set. fake moves
no bytes and cannot pair across processes, so it runs both sides in one spawned process on a
FakeHub: its time is the control plane alone (no checksum; its GB/s is not a throughput).

    how to run (about 2-4 min on an idle machine, most of it starting process pairs and NIXL agents;
    memory at most about 2 x --room-mib plus tcp's window: one pool per side, or the reference's two):
      python benchmarks/pd_transfer.py                              # tcp,nixl,fake; 64K,256K,1M; 256 MiB x 4 rooms
      python benchmarks/pd_transfer.py --room-mib 1024 --rooms 3    # bigger rooms
      python benchmarks/pd_transfer.py --backends tcp,mooncake --page-kib 64,1024
    smoke: --room-mib 16 --rooms 2
"""
from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import torch

PAGE_SIZE = 16  # tokens per page
HEAD_DIM = 128
DTYPE = torch.bfloat16
POLL_S = 0.0005  # the processes' poll loop sleeps this long (they must leave the CPU to the transport thread)
CONFIG = dict(bootstrap_host="127.0.0.1", bootstrap_port=0, bootstrap_timeout_s=120.0, waiting_timeout_s=120.0,
              transfer_timeout_s=300.0)


def shape_for(page_bytes: int, num_layers: int) -> tuple[int, int]:
    """(heads, row bytes): a page row of one layer tensor is PAGE_SIZE x heads x HEAD_DIM bf16."""
    row = page_bytes // (2 * num_layers)
    per_head = PAGE_SIZE * HEAD_DIM * DTYPE.itemsize
    if row * 2 * num_layers != page_bytes or row % per_head:
        raise ValueError(f"page bytes {page_bytes}: must be 2 x {num_layers} layers x a multiple of {per_head} "
                         f"({PAGE_SIZE} tokens x {HEAD_DIM} x bf16)")
    return row // per_head, row


def make_pool(num_pages: int, heads: int, num_layers: int, seed: int | None,
              device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """seed None: zeros; else random bytes (every bit pattern, so a lost or moved byte changes a sum)."""
    shape = (num_pages, PAGE_SIZE, heads, HEAD_DIM)
    if seed is None:
        return [{n: torch.zeros(shape, dtype=DTYPE, device=device) for n in ("k", "v")} for _ in range(num_layers)]
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randint(-2**15, 2**15, shape, dtype=torch.int16, generator=g).view(DTYPE).to(device)
             for n in ("k", "v")} for _ in range(num_layers)]


def page_sums(layers: list[dict[str, torch.Tensor]], pages: list[int]) -> list[int]:
    """Per page (in the order given): a checksum of its bytes over every layer and tensor, the sum
    of its int64 words each times its position (1, 2, ...; wrapping), so a changed, lost or moved
    word changes it."""
    idx = torch.tensor(pages)
    total = torch.zeros(len(pages), dtype=torch.int64)
    pos = 0
    for layer in layers:
        for t in layer.values():
            words = t.index_select(0, idx.to(t.device)).cpu().reshape(len(pages), -1).view(torch.int64)
            total += (words * torch.arange(pos + 1, pos + 1 + words.shape[1], dtype=torch.int64)).sum(1)
            pos += words.shape[1]
    return total.tolist()


def room_pages(room: int, num_pages: int) -> tuple[list[int], list[int]]:
    shift = (room * 7919) % num_pages
    return [(p + shift) % num_pages for p in range(num_pages)], list(range(num_pages))[::-1]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(POLL_S)


def _side_main(mode: str, backend: str, pool: tuple, threads: int, conn, device: str = "cpu") -> None:
    """One side in its own process; commands from the parent on `conn`. Exits with os._exit (NIXL
    may crash in interpreter finalization after making an agent)."""
    code = 0
    try:
        torch.set_num_threads(threads)
        from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport
        num_pages, heads, num_layers = pool
        layers = make_pool(num_pages, heads, num_layers, seed=1 if mode == "prefill" else None, device=device)
        transport = make_transport(DisaggConfig(mode, transfer_backend=backend, **CONFIG), layers, "pd-transfer-bench")
        conn.send(("ready", transport.bootstrap_addr))
        done = (KVPoll.Success, KVPoll.Failed)
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            room = cmd[1]
            src, dst = room_pages(room, num_pages)
            if cmd[0] == "send":
                s = transport.sender(room)
                s.init(num_pages)
                wait_for(lambda: s.poll() != KVPoll.Bootstrapping, 120, "the decode side's registration")
                t0 = time.monotonic()
                s.send(src, Aux(7))
                wait_for(lambda: s.poll() in done, 300, "the sender to end")
                t1 = time.monotonic()
                conn.send(("sent", s.poll().name, s.failure, t0, t1, page_sums(layers, src)))
            elif cmd[0] == "receive":
                for layer in layers:
                    for t in layer.values():
                        t.zero_()
                r = transport.receiver(room, cmd[2])
                r.init()
                r.post_buffers(dst)
                conn.send(("posted",))
                wait_for(lambda: r.poll() in done, 300, "the receiver to end")
                t1 = time.monotonic()
                conn.send(("received", r.poll().name, r.failure, t1, page_sums(layers, dst)))
        transport.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        code = 1
    conn.close()
    os._exit(code)


def _fake_main(rooms: int, num_pages: int, threads: int, conn) -> None:
    """fake: both sides in this one process on a FakeHub (no bytes move; the control plane alone)."""
    code = 0
    try:
        torch.set_num_threads(threads)
        from ketch.disagg import Aux, DisaggConfig, KVPoll
        from ketch.disagg.fake import FakeHub, FakeTransport
        hub = FakeHub()
        pre = FakeTransport(DisaggConfig("prefill", transfer_backend="fake", **CONFIG), hub)
        dec = FakeTransport(DisaggConfig("decode", transfer_backend="fake", **CONFIG), hub)
        done = (KVPoll.Success, KVPoll.Failed)
        for room in range(rooms):
            src, dst = room_pages(room, num_pages)
            s, r = pre.sender(room), dec.receiver(room, "fake:0")
            s.init(num_pages)
            r.init()
            r.post_buffers(dst)
            wait_for(lambda: s.poll() != KVPoll.Bootstrapping, 60, "registration")
            t0 = time.monotonic()
            s.send(src, Aux(7))
            wait_for(lambda: s.poll() in done and r.poll() in done, 60, "both sides")
            ok = s.poll() == r.poll() == KVPoll.Success
            conn.send(("fake", ok, s.failure or r.failure, time.monotonic() - t0))
        pre.close()
        dec.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        code = 1
    conn.close()
    os._exit(code)


def _expect(conn, kind: str, timeout_s: float = 600) -> tuple:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no {kind!r} from a side within {timeout_s} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"a side failed:\n{msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(f"expected {kind!r}, got {msg!r}")
    return msg


def run_pair(ctx, backend: str, num_pages: int, heads: int, num_layers: int, rooms: int,
             warmup: int, threads: int, device: str = "cpu") -> list[float | str]:
    """Seconds per timed room (a string naming the failure for a room that failed or whose bytes
    differ); the first `warmup` rooms are run and checked the same way but not returned."""
    if backend == "fake":
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_fake_main, args=(warmup + rooms, num_pages, threads, theirs), daemon=True)
        proc.start()
        try:
            out = []
            for _ in range(warmup + rooms):
                _, ok, why, secs = _expect(ours, "fake")
                out.append(secs if ok else f"FAILED: {why}")
            return out[:warmup] if any(isinstance(s, str) for s in out[:warmup]) else out[warmup:]
        finally:
            proc.join(30)
            proc.kill()
    pipes = {m: ctx.Pipe() for m in ("prefill", "decode")}
    procs = {m: ctx.Process(target=_side_main, args=(m, backend, (num_pages, heads, num_layers), threads, pipes[m][1],
                                                     device), daemon=True) for m in pipes}
    for p in procs.values():
        p.start()
    pre, dec = pipes["prefill"][0], pipes["decode"][0]
    try:
        addr = _expect(pre, "ready")[1]
        _expect(dec, "ready")
        out = []
        for room in range(1, warmup + rooms + 1):
            pre.send(("send", room))
            dec.send(("receive", room, addr))
            _expect(dec, "posted")
            _, s_state, s_why, t0, t1, sent = _expect(pre, "sent")
            _, r_state, r_why, t2, got = _expect(dec, "received")
            if s_state != "Success" or r_state != "Success":
                out.append(f"FAILED: sender {s_state} {s_why}; receiver {r_state} {r_why}")
            elif sent != got:
                bad = sum(a != b for a, b in zip(sent, got))
                out.append(f"FAILED: {bad} of {len(sent)} pages differ at the decode side")
            else:
                out.append(max(t1, t2) - t0)
        for c in (pre, dec):
            c.send(("quit",))
        return out[:warmup] if any(isinstance(s, str) for s in out[:warmup]) else out[warmup:]
    finally:
        for p in procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()


def reference(num_pages: int, heads: int, num_layers: int, rooms: int, device: str = "cpu") -> tuple[float, float]:
    """Median seconds of (copy_ of whole tensors, index_copy_ of the rooms' page rows), same bytes;
    room 0 is a warm-up (the destination's first touch faults its memory in). On CUDA: a
    device-to-device copy within one GPU, timed to its end."""
    src = make_pool(num_pages, heads, num_layers, seed=1, device=device)
    dst = make_pool(num_pages, heads, num_layers, seed=None, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    plain, paged = [], []
    for room in range(rooms + 1):
        s_pages, d_pages = (torch.tensor(p, device=device) for p in room_pages(room, num_pages))
        sync()
        t0 = time.perf_counter()
        for s, d in zip(src, dst):
            for n in s:
                d[n].copy_(s[n])
        sync()
        t1 = time.perf_counter()
        for s, d in zip(src, dst):
            for n in s:
                d[n].index_copy_(0, d_pages, s[n].index_select(0, s_pages))
        sync()
        t2 = time.perf_counter()
        if room:
            plain.append(t1 - t0)
            paged.append(t2 - t1)
        assert page_sums(dst, d_pages.tolist()) == page_sums(src, s_pages.tolist())
    return statistics.median(plain), statistics.median(paged)


def machine() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "?"
    return f"{model}; {os.cpu_count()} cpus; torch {torch.__version__} ({torch.get_num_threads()} threads)"


class _Rows(list):
    """The table, each row printed as it is measured (a run cut short still shows what it did)."""

    def __init__(self) -> None:
        super().__init__()
        print("\n| page | layer row | pages/room | backend | GB/s | ms/room | note |\n|---|---|---|---|---|---|---|",
              flush=True)

    def append(self, row: tuple) -> None:
        super().append(row)
        kib, n_row, n, backend, gbs, secs, note = row
        gb = "n/a" if gbs is None or backend == "fake" else f"{gbs:.2f}"
        ms = "n/a" if secs is None else f"{secs * 1e3:.2f}"
        print(f"| {kib} KiB | {n_row >> 10} KiB | {n} | {backend} | {gb} | {ms} | {note} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backends", default="tcp,nixl,fake", help="comma-separated make_transport backend names")
    p.add_argument("--page-kib", default="64,256,1024", help="page bytes (all layers, K and V) in KiB, comma-separated")
    p.add_argument("--layers", type=int, default=8, help="layers of the pool (page row = page bytes / (2 x layers))")
    p.add_argument("--room-mib", type=int, default=256, help="MiB moved per room (the whole pool)")
    p.add_argument("--rooms", type=int, default=4, help="timed rooms per backend and page size (median reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads in every process (the tcp receiver's index_copy_ and the reference use "
                        "them; more than the free cores of a busy machine makes copies wait on one another)")
    p.add_argument("--warmup-rooms", type=int, default=1, help="rooms run and checked first, not timed")
    p.add_argument("--device", default="cpu", help="where both pools live: cpu, or cuda (two processes on one GPU; "
                   "nixl then moves GPU memory: leave UCX_TLS unset so UCX may pick cuda_ipc)")
    a = p.parse_args(argv)
    backends = [b for b in a.backends.split(",") if b]
    pages_kib = [int(x) for x in a.page_kib.split(",")]
    if a.rooms < 1 or a.room_mib < 1 or a.warmup_rooms < 0:
        p.error("--rooms and --room-mib: >= 1; --warmup-rooms: >= 0")
    torch.set_num_threads(a.threads)
    if a.device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp")  # nixl: before a child starts UCX (children inherit it)
    print(f"# pd_transfer: {' '.join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])])}")
    commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    print(f"# date {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; commit {commit}; {machine()}; "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(unset)')}; device {a.device}")
    print(f"# page = {PAGE_SIZE} tokens x {a.layers} layers x K,V of [heads, {HEAD_DIM}] bf16; {a.room_mib} MiB per "
          f"room, {a.rooms} rooms after {a.warmup_rooms} warm-up; GB/s = 1e9 B/s of room bytes, send() -> both sides "
          f"Success, median room; per-page checksums verified")
    ctx = mp.get_context("spawn")
    rows = _Rows()
    for kib in pages_kib:
        heads, row = shape_for(kib << 10, a.layers)
        num_pages = max(1, (a.room_mib << 20) // (kib << 10))
        room_bytes = num_pages * (kib << 10)
        plain, paged = reference(num_pages, heads, a.layers, a.rooms, a.device)
        rows.append((kib, row, num_pages, f"memcpy (copy_, 1 process, {a.device})", room_bytes / plain / 1e9, plain, ""))
        rows.append((kib, row, num_pages, "index_copy_ (1 process)", room_bytes / paged / 1e9, paged, ""))
        for backend in backends:
            if backend == "nixl" and importlib.util.find_spec("nixl") is None:
                rows.append((kib, row, num_pages, backend, None, None, "skipped: nixl does not import"))
                continue
            try:
                from ketch.disagg import DisaggConfig
                DisaggConfig("prefill", transfer_backend=backend)
                results = run_pair(ctx, backend, num_pages, heads, a.layers, a.rooms, a.warmup_rooms, a.threads,
                                   a.device)
            except Exception as e:  # a backend that cannot run here is a row that says why, not the end
                rows.append((kib, row, num_pages, backend, None, None, f"error: {str(e).strip().splitlines()[-1]}"))
                continue
            ok = [s for s in results if isinstance(s, float)]
            failed = [s for s in results if isinstance(s, str)]
            secs = statistics.median(ok) if ok else None
            note = ("control plane only, no bytes moved; " if backend == "fake" else "") + \
                   (f"{len(failed)} of {len(results)} rooms {failed[0]}" if failed else f"rooms: {len(ok)}")
            rows.append((kib, row, num_pages, backend, room_bytes / secs / 1e9 if secs else None, secs, note))
        print(f"# {kib} KiB pages done", file=sys.stderr, flush=True)
    return 1 if any(r[6].startswith("error") or "FAILED" in r[6] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
