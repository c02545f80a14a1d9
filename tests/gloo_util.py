"""Run a function on N ranks of a real torch.distributed gloo group on the CPU (spawned
processes on loopback), each handed its `ParallelContext`; results come back through files.

The group's TCP store listens in this process (port 0: the OS picks it while binding) before any
rank starts, so no other socket can take the port between its choice and its use."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ketch.parallel import ParallelContext


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], out_dir: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core box
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = fn(ParallelContext.from_group(dist.group.WORLD), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # The result is saved and the group gone; the interpreter's own exit then ran C++ teardown
    # that aborted the process ("terminate called without an active exception", torch 2.13 gloo)
    # in 20-60 % of runs on a 2-core box, failing a rank that had done its work. Leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[..., Any], world: int, out_dir: Path, *args: Any) -> list[Any]:
    """fn(parallel, *args) on each rank (a module-level function: the children import it);
    returns each rank's result, in rank order."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    mp.spawn(_entry, args=(world, store.port, fn, str(out_dir), args), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
