"""Rank 0's side of tensor parallelism: start ranks 1..N-1, join their process group, send each
step to them, and take the engine down when one dies.

    engine process (rank 0: Engine, scheduler, sampler, ModelRunner of shard 0)
      ├── ketch-tp1 (tp_worker.py: ModelRunner of shard 1)
      └── ...       every rank runs each forward; the layers' collectives join them inside it

Each step rank 0 broadcasts the ForwardBatch, then (after sampling) the sampled ids
(batch_wire.py); a worker has nothing to decide, so every rank runs the same collectives in
the same order.

A dead rank would leave the others blocked in a collective forever, so a thread waits on the
workers' sentinels: when one exits while the engine is not closing, it names the rank on
stderr and ends this process at once (os._exit: the main thread may be stuck inside gloo or
nccl and could never unwind). For `ketch serve` that process is the engine process, and the
API process sees it exit; for `ketch.LLM` it is the caller's process.
"""
from __future__ import annotations

import atexit
import multiprocessing.connection
import os
import socket
import sys
import threading
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ketch.config import EngineConfig, ModelConfig
from ketch.engine import batch_wire as wire
from ketch.forward_batch import ForwardBatch
from ketch.models.registry import family_for
from ketch.parallel import ExpertParallel, ParallelContext
from ketch.weights.source import ModelSource

DEAD_RANK_EXIT = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """CUDA: rank r drives GPU r (one host). The CPU: every rank on the CPU."""
    if config.torch_device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


def check_no_group() -> None:
    if dist.is_initialized():
        raise ValueError("tensor_parallel_size: this process already belongs to a tensor-parallel group "
                         "(close the other engine first)")


def expert_parallel(config: EngineConfig) -> ExpertParallel:
    """How the MoE layers use the ranks (ketch/parallel/expert.py): EP over the TP ranks, EPLB."""
    return ExpertParallel(config.ep_size, num_redundant=config.ep_num_redundant_experts,
                          eplb_interval=config.eplb_rebalance_num_iterations if config.enable_eplb else 0)


def init_rank(config: EngineConfig, rank: int, port: int) -> ParallelContext:
    """Join the ranks' group (gloo on the CPU, nccl on CUDA) through rank 0's TCP store."""
    check_no_group()
    device = rank_config(config, rank).torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=config.tensor_parallel_size)
    return ParallelContext.from_group(dist.group.WORLD, expert_parallel(config))


class TensorParallelRanks:
    """Rank 0's handle on the workers; `parallel` is rank 0's context."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 source: ModelSource) -> None:
        from ketch.engine.tp_worker import run_worker  # the workers' entry point (spawn imports it)

        # a second TP engine in this process, or a split the model cannot take, fails here
        # (naming the field) before any rank starts
        check_no_group()
        family_for(model_config.architecture).kv_spec(model_config, ParallelContext(0, config.tensor_parallel_size))
        if config.ep_size > 1 and not getattr(model_config, "num_experts", 0):
            raise ValueError(f"ep_size: {model_config.architecture} has no routed experts to split")
        self.device = rank_config(config, 0).torch_device
        self._closing = False
        port = free_port()
        ctx = mp.get_context("spawn")  # never fork: torch and ZMQ state do not survive it
        self.procs = [ctx.Process(target=run_worker, name=f"ketch-tp{r}", daemon=True,
                                  args=(config, model_config, max_model_len, source, r, port, os.getpid()))
                      for r in range(1, config.tensor_parallel_size)]
        for p in self.procs:
            p.start()
        # from here a worker that dies (during its start-up too) ends this process
        threading.Thread(target=self._watch, name="ketch-tp-watch", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's exit hook terminates the workers
        try:
            self.parallel = init_rank(config, 0, port)
        except BaseException:
            self._kill_workers()  # they wait for a rank 0 that will not come
            raise

    def send_step(self, batch: ForwardBatch) -> None:
        self._send(wire.step_header(batch), wire.step_payload(batch))

    def send_sampled(self, token_ids: torch.Tensor) -> None:
        ids = token_ids.to(self.device, torch.int64)
        self._send(wire.control_header(wire.Op.SAMPLED, ids.shape[0]), None)
        dist.broadcast(ids, src=0, group=self.parallel.group)

    def close(self) -> None:
        """Tell the workers to stop and wait for them; idempotent."""
        if self._closing or not dist.is_initialized():
            return
        self._closing = True
        try:
            self._send(wire.control_header(wire.Op.SHUTDOWN), None)
        except RuntimeError:
            pass  # a worker is already gone: nothing to tell
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        dist.destroy_process_group()

    def abandon(self) -> None:
        """Rank 0 failed while starting: kill the workers (they may be inside a collective that
        will never complete) without a word to them."""
        self._kill_workers()
        dist.destroy_process_group()

    def _kill_workers(self) -> None:
        self._closing = True  # their exits are expected now: the watcher stays quiet
        for p in self.procs:
            p.kill()
            p.join()

    def _send(self, header: np.ndarray, payload: np.ndarray | None) -> None:
        dist.broadcast(wire.to_wire(header, self.device), src=0, group=self.parallel.group)
        if payload is not None and payload.size:
            dist.broadcast(wire.to_wire(payload, self.device), src=0, group=self.parallel.group)

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(timeout=5)  # the sentinel fires before the exit code is collected
        rank = self.procs.index(dead) + 1
        print(f"ketch: tensor-parallel rank {rank} (pid {dead.pid}) exited with code {dead.exitcode}",
              file=sys.stderr, flush=True)
        os._exit(DEAD_RANK_EXIT)
