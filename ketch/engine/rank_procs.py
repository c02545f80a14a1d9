"""Ranks 1..N-1 as spawned processes, and the watcher that ends this process when one dies.

Shared by tensor parallelism (tp_ranks.py: the workers run rank 0's steps) and DP attention
(dp_attention.py: every rank runs an engine of its own). A dead rank would leave the others
blocked in a collective forever, so a thread waits on the ranks' sentinels: when one exits while
the engine is not closing, it names the rank on stderr and ends this process at once (os._exit:
the main thread may be stuck inside gloo or nccl and could never unwind). For `ketch serve` that
process is the engine process, and the API process sees it exit; for `ketch.LLM` it is the
caller's process.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEAD_RANK_EXIT = 1


class RankProcesses:
    def __init__(self, target: Callable[..., None], args_of: Callable[[int], tuple[Any, ...]], world_size: int,
                 what: str) -> None:
        """Start ranks 1..world_size-1 as `target(*args_of(rank))`; `what` names them ("tensor-parallel")."""
        self.what, self.closing = what, False
        ctx = mp.get_context("spawn")  # never fork: torch and ZMQ state do not survive it
        self.procs = [ctx.Process(target=target, name=f"ketch-rank{r}", daemon=True, args=args_of(r))
                      for r in range(1, world_size)]
        for p in self.procs:
            p.start()
        # from here a rank that dies (during its start-up too) ends this process
        threading.Thread(target=self._watch, name="ketch-rank-watch", daemon=True).start()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (they were told to); kill what is left after `timeout`."""
        self.closing = True
        for p in self.procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
                p.join()

    def kill(self) -> None:
        self.closing = True  # their exits are expected now: the watcher stays quiet
        for p in self.procs:
            p.kill()
            p.join()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(timeout=5)  # the sentinel fires before the exit code is collected
        rank = self.procs.index(dead) + 1
        print(f"ketch: {self.what} rank {rank} (pid {dead.pid}) exited with code {dead.exitcode}",
              file=sys.stderr, flush=True)
        os._exit(DEAD_RANK_EXIT)
