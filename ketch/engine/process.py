"""The engine process: an `Engine` driven by a ZMQ loop.

    API ──PUSH──▶ [input PULL]  drain → add/abort/ping → engine.step() → [output PUSH] ──▶ API

When requests are running the loop drains its input without blocking and steps; when idle it
blocks on the input socket (with a timeout, to notice a parent that died without a word). Aborts
and new requests are applied between steps only. A bad request (a field of the wrong type for the
typed decode, or a ValueError from SamplingParams / add_request) is answered with a RequestError
for its id; anything else that escapes is fatal: EngineError, exit 1.

A thread of its own sends a Heartbeat every HEARTBEAT_S with the number of steps run so far, so
the API process's watchdog can tell a live engine from a frozen process (no beats) or a step
loop stuck in one step (beats, busy, and the count does not move) without asking the loop.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import threading
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from ketch.config import EngineConfig
from ketch.engine import messages as m

_IDLE_POLL_MS = 1000  # idle: wake this often to check that the parent is still alive


def start_engine_process(config: EngineConfig, eos_token_ids: tuple[int, ...], input_addr: str,
                         output_addr: str) -> multiprocessing.Process:
    """Spawn (never fork: torch and ZMQ state do not survive it) the engine process."""
    ctx = multiprocessing.get_context("spawn")
    # daemonic processes may not start children: with TP > 1 the engine process starts its
    # ranks, so it is not one (it still ends with the API process: Shutdown, or the orphan check)
    proc = ctx.Process(target=run_engine, args=(config, eos_token_ids, input_addr, output_addr, os.getpid()),
                       name="ketch-engine", daemon=config.tensor_parallel_size == 1)
    proc.start()
    return proc


@dataclass
class _Progress:
    """What the heartbeat thread reports; written by the loop, read by the thread (plain ints
    and bools: each assignment is atomic under the GIL)."""

    steps: int = 0
    busy: bool = False


def _beat(zctx: zmq.Context, output_addr: str, progress: _Progress, stop: threading.Event) -> None:
    sock = zctx.socket(zmq.PUSH)  # a socket per thread: ZMQ sockets are not thread-safe
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(output_addr)
    try:
        while not stop.wait(m.HEARTBEAT_S):
            try:
                sock.send(m.encode(m.Heartbeat(progress.steps, progress.busy)), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the API process is not reading right now: this beat is dropped, the next one goes
    except zmq.ZMQError:
        pass  # the context is closing
    finally:
        sock.close()


def run_engine(config: EngineConfig, eos_token_ids: tuple[int, ...], input_addr: str, output_addr: str,
               parent_pid: int) -> None:
    zctx = zmq.Context()
    inbox = zctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = zctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)  # let the last message (e.g. EngineError) leave before exit
    outbox.connect(output_addr)
    progress, stop = _Progress(), threading.Event()
    beat = threading.Thread(target=_beat, args=(zctx, output_addr, progress, stop), name="ketch-heartbeat",
                            daemon=True)
    code = 0
    try:
        from ketch.engine.engine import Engine

        engine = Engine(config, eos_token_ids=eos_token_ids)
        # Everything built so far (torch, the model's modules, graphs) lives as long as the
        # process: keep it out of the cyclic GC, whose full passes over it stalled the GPU
        # ~0.15 s each in long runs.
        gc.freeze()
        capacity = engine.runner.pool.num_pages * config.page_size
        outbox.send(m.encode(m.EngineReady(engine.max_model_len, engine.vocab_size, capacity)))
        beat.start()  # after EngineReady: start-up has its own deadline in the API process
        _loop(engine, inbox, outbox, parent_pid, progress)
        engine.close()
    except Exception as e:
        traceback.print_exc()
        outbox.send(m.encode(m.EngineError(f"{type(e).__name__}: {e}")))
        code = 1
    stop.set()
    if beat.is_alive():
        beat.join()
    outbox.close()
    inbox.close()
    zctx.term()
    if code:
        sys.exit(code)


def _loop(engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int, progress: _Progress) -> None:
    while True:
        if os.getppid() != parent_pid:  # orphaned: the API process is gone, and nobody reads our work
            return
        busy = progress.busy = engine.has_unfinished()
        if not busy and not inbox.poll(_IDLE_POLL_MS):
            continue
        replies: list[m.FromEngine] = []
        while True:  # drain whatever has arrived, without blocking
            try:
                data = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = m.decode_to_engine(data)
            except msgspec.ValidationError as e:
                reply = m.undecodable_request(data, e)
                if reply is None:  # not a request we can answer: the two processes disagree
                    raise
                replies.append(reply)
                continue
            if isinstance(msg, m.Shutdown):
                return
            reply = _handle(engine, msg)
            if reply is not None:
                replies.append(reply)
        for reply in replies:
            outbox.send(m.encode(reply))
        if engine.has_unfinished():
            progress.busy = True
            outputs = engine.step()
            progress.steps += 1
            if outputs:
                outbox.send(m.encode(m.TokenOutputs([m.TokenDelta.from_output(o) for o in outputs])))


def _handle(engine, msg: m.ToEngine) -> m.FromEngine | None:
    if isinstance(msg, m.GenerateRequest):
        try:
            engine.add_request(msg.request_id, msg.prompt_ids, msg.params.to_params())
        except ValueError as e:
            return m.RequestError(msg.request_id, str(e))
    elif isinstance(msg, m.AbortRequest):
        engine.abort(msg.request_id, msg.index)
    elif isinstance(msg, m.Ping):
        return m.Pong(msg.nonce, engine.stats())
    return None
