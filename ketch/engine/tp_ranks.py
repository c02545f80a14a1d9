"""Rank 0's side of tensor parallelism: start ranks 1..N-1, join their process group, send each
step to them, and take the engine down when one dies.

    engine process (rank 0: Engine, scheduler, sampler, ModelRunner of shard 0)
      ├── ketch-rank1 (tp_worker.py: ModelRunner of shard 1)
      └── ...       every rank runs each forward; the layers' collectives join them inside it

Each step rank 0 broadcasts the ForwardBatch, then (after sampling) the sampled ids
(batch_wire.py); a worker has nothing to decide, so every rank runs the same collectives in
the same order.

A rank that dies ends this process (rank_procs.py).
"""
from __future__ import annotations

import atexit
import os
from dataclasses import replace
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ketch.config import EngineConfig, ModelConfig
from ketch.engine import batch_wire as wire
from ketch.engine.rank_procs import RankProcesses
from ketch.forward_batch import ForwardBatch
from ketch.models.registry import family_for
from ketch.parallel import ExpertParallel, ParallelContext
from ketch.weights.source import ModelSource

# How long a collective waits for the other ranks. The workers wait in one for rank 0's next
# step, however long the server idles; torch's default (30 minutes) would end them, and with
# them the engine, after half an hour without a request. A rank that dies is seen by its
# process's exit (rank_procs.py) or by the closed connections, not by this timeout.
RANK_WAIT = timedelta(days=365)


def rank0_store(config: EngineConfig) -> dist.TCPStore:
    """Rank 0's TCP store, listening before any other rank starts on a port the OS picked while
    binding it; `.port` tells the ranks where. (A port picked free, closed and bound again later
    can be taken in between by any connection on the machine: rank 0 once failed with EADDRINUSE.)"""
    return dist.TCPStore("127.0.0.1", 0, config.tensor_parallel_size, is_master=True, timeout=RANK_WAIT,
                         wait_for_workers=False)


def rank_store(config: EngineConfig, port: int) -> dist.TCPStore:
    """Rank r > 0's connection to rank 0's store."""
    return dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=RANK_WAIT)


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
    return ExpertParallel(config.ep_size, dp_attention=config.enable_dp_attention,
                          num_redundant=config.ep_num_redundant_experts,
                          eplb_interval=config.eplb_rebalance_num_iterations if config.enable_eplb else 0)


def init_rank(config: EngineConfig, rank: int, store: dist.Store) -> ParallelContext:
    """Join the ranks' group (gloo on the CPU, nccl on CUDA) through rank 0's TCP store (every rank
    passes its store object: torch namespaces a store it makes from a URL itself, one passed in
    not at all, so the ranks must all do the same)."""
    check_no_group()
    device = rank_config(config, rank).torch_device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=RANK_WAIT)
    return ParallelContext.from_group(dist.group.WORLD, expert_parallel(config))


class TensorParallelRanks:
    """Rank 0's handle on the workers; `parallel` is rank 0's context."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 source: ModelSource) -> None:
        from ketch.engine.tp_worker import run_worker  # the workers' entry point (spawn imports it)

        # a second TP engine in this process, or a split the model cannot take, fails here
        # (naming the field) before any rank starts
        check_no_group()
        family_for(model_config.architecture).kv_spec(
            model_config, ParallelContext(0, config.tensor_parallel_size, ep=expert_parallel(config)))
        if config.ep_size > 1 and not getattr(model_config, "num_experts", 0):
            raise ValueError(f"ep_size: {model_config.architecture} has no routed experts to split")
        self.device = rank_config(config, 0).torch_device
        store = rank0_store(config)
        self._ranks = RankProcesses(run_worker, lambda r: (config, model_config, max_model_len, source, r, store.port,
                                                           os.getpid()), config.tensor_parallel_size, "tensor-parallel")
        self.procs = self._ranks.procs
        atexit.register(self.close)  # before multiprocessing's exit hook terminates the workers
        try:
            self.parallel = init_rank(config, 0, store)
        except BaseException:
            self._ranks.kill()  # they wait for a rank 0 that will not come
            raise

    def send_step(self, batch: ForwardBatch) -> None:
        self._send(wire.step_header(batch), wire.step_payload(batch))

    def send_sampled(self, token_ids: torch.Tensor) -> None:
        ids = token_ids.to(self.device, torch.int64)
        self._send(wire.control_header(wire.Op.SAMPLED, ids.shape[0]), None)
        dist.broadcast(ids, src=0, group=self.parallel.group)

    def close(self) -> None:
        """Tell the workers to stop and wait for them; idempotent."""
        if self._ranks.closing or not dist.is_initialized():
            return
        self._ranks.closing = True
        try:
            self._send(wire.control_header(wire.Op.SHUTDOWN), None)
        except RuntimeError:
            pass  # a worker is already gone: nothing to tell
        self._ranks.join()
        dist.destroy_process_group()

    def abandon(self) -> None:
        """Rank 0 failed while starting: kill the workers (they may be inside a collective that
        will never complete) without a word to them."""
        self._ranks.kill()
        dist.destroy_process_group()

    def _send(self, header: np.ndarray, payload: np.ndarray | None) -> None:
        dist.broadcast(wire.to_wire(header, self.device), src=0, group=self.parallel.group)
        if payload is not None and payload.size:
            dist.broadcast(wire.to_wire(payload, self.device), src=0, group=self.parallel.group)
