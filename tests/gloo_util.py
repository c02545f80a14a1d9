"""Run a function on N ranks of a real torch.distributed gloo group on the CPU (spawned
processes on loopback), each handed its `ParallelContext`; results come back through files."""
from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ketch.parallel import ParallelContext


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], out_dir: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core box
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(ParallelContext.from_group(dist.group.WORLD), *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable[..., Any], world: int, out_dir: Path, *args: Any) -> list[Any]:
    """fn(parallel, *args) on each rank (a module-level function: the children import it);
    returns each rank's result, in rank order."""
    mp.spawn(_entry, args=(world, free_port(), fn, str(out_dir), args), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
