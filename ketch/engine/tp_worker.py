"""A tensor-parallel worker (ranks 1..N-1): its shard of the model and its KV pool, driven by
rank 0's broadcasts (batch_wire.py). It decides nothing: STEP runs the forward (the layers'
collectives meet rank 0's inside it), SAMPLED publishes rank 0's ids into this rank's
FutureTokens so the next step's placeholders resolve to the same ids, SHUTDOWN returns.

It ends when rank 0 does: a broadcast from a rank that is gone fails (the group's connections
close), and between messages the parent pid is checked as the engine process does.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ketch.config import EngineConfig, ModelConfig
from ketch.engine import batch_wire as wire
from ketch.engine.tp_ranks import init_rank, rank_config, rank_store
from ketch.parallel import ParallelContext
from ketch.runner.model_runner import ModelRunner
from ketch.weights.source import ModelSource


def run_worker(config: EngineConfig, model_config: ModelConfig, max_model_len: int, source: ModelSource, rank: int,
               port: int, parent_pid: int) -> None:
    parallel = init_rank(config, rank, rank_store(config, port))
    # built in step with rank 0's runner: the pool size is agreed by a collective inside
    try:
        runner = ModelRunner(rank_config(config, rank), model_config, max_model_len, source, parallel)
    except ValueError as e:  # a setting (a split the model cannot take): rank 0 builds the same and says it
        print(f"ketch: tensor-parallel rank {rank}: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        _loop(runner, parallel, parent_pid)
    except RuntimeError as e:  # rank 0 went away in the middle of a collective
        if os.getppid() == parent_pid:
            raise
        print(f"ketch: tensor-parallel rank {rank}: rank 0 is gone ({e})", file=sys.stderr)
        sys.exit(1)
    dist.destroy_process_group()


def _loop(runner: ModelRunner, parallel: ParallelContext, parent_pid: int) -> None:
    device, group = runner.device, parallel.group
    header = torch.empty(wire.HEADER_LEN, dtype=torch.int64, device=device)
    while os.getppid() == parent_pid:
        dist.broadcast(header, src=0, group=group)
        head = header.cpu().numpy()
        payload = torch.empty(wire.payload_len(head), dtype=torch.int64, device=device)
        if payload.numel():
            dist.broadcast(payload, src=0, group=group)
        op = wire.Op(int(head[0]))
        if op is wire.Op.SHUTDOWN:
            return
        if op is wire.Op.STEP:
            runner.forward(wire.decode_step(head, payload.cpu().numpy()))
        else:
            runner.future.publish(payload)
