"""The engine process: an `Engine` driven by a ZMQ loop.

    API ──PUSH──▶ [input PULL]  drain → add/abort/ping/flush → engine.step() → [output PUSH] ──▶ API

With `--api-server-count N` there are N API processes: the input socket pulls from all of them
(fair-queued), and each has its own output socket (outboxes.py): a request's outputs go back to
the process that sent it.

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
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from ketch.config import EngineConfig
from ketch.engine import messages as m
from ketch.engine.outboxes import Outboxes
from ketch.instance_id import new_instance_id

_IDLE_POLL_MS = 1000  # idle: wake this often to check that the parent is still alive


def start_engine_process(config: EngineConfig, input_addrs: list[str],
                         output_addrs: list[str]) -> tuple[multiprocessing.Process, Connection]:
    """Spawn (never fork: torch and ZMQ state do not survive it) the engine process; one input and
    one output address per API process, in origin order. Returns the process and the pipe end on
    which the caller sends the tokenizer's EOS ids (a tuple): the engine imports its modules while
    the caller loads the tokenizer, and waits for them before it builds; closing the pipe unsent
    ends it."""
    ctx = multiprocessing.get_context("spawn")
    eos_in, eos_out = ctx.Pipe(duplex=False)
    # daemonic processes may not start children: with TP > 1 the engine process starts its
    # ranks, so it is not one (it still ends with the API process: Shutdown, or the orphan check)
    proc = ctx.Process(target=run_engine, args=(config, eos_in, input_addrs, output_addrs, os.getpid()),
                       name="ketch-engine", daemon=config.tensor_parallel_size == 1)
    proc.start()
    eos_in.close()  # the child's copy is the one that reads
    return proc, eos_out


@dataclass
class _Progress:
    """What the heartbeat thread reports; written by the loop, read by the thread (plain ints
    and bools: each assignment is atomic under the GIL)."""

    steps: int = 0
    busy: bool = False


def _beat(zctx: zmq.Context, output_addrs: list[str], progress: _Progress, stop: threading.Event) -> None:
    socks = [zctx.socket(zmq.PUSH) for _ in output_addrs]  # sockets of this thread: ZMQ's are not thread-safe
    for sock, addr in zip(socks, output_addrs, strict=True):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
    try:
        while not stop.wait(m.HEARTBEAT_S):
            beat = m.encode(m.Heartbeat(progress.steps, progress.busy))
            for sock in socks:
                try:
                    sock.send(beat, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # that API process is not reading right now: this beat is dropped, the next one goes
    except zmq.ZMQError:
        pass  # the context is closing
    finally:
        for sock in socks:
            sock.close()


# After a SIGTERM/SIGINT, how long the API process's Shutdown may take to come: above the default
# --shutdown-timeout (30 s); a server given a longer drain loses its engine here (not passed down yet).
_STOP_GRACE_S = 60.0


class _StopSignal:
    """A SIGTERM or SIGINT sent to the whole process group (systemd's default KillMode, `kill -TERM
    -PGID`, Ctrl-C) reaches this process too, while the API process drains its streams
    (--shutdown-timeout): the engine must go on serving them until the API process's Shutdown.
    The API process owns the end; the signal only starts a grace period after which the engine
    ends anyway (so a parent that signals and waits, like multiprocessing's exit hook, is not kept
    waiting for ever)."""

    at: float | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, cls._note)

    @classmethod
    def _note(cls, signum: int, frame: object) -> None:
        if cls.at is None:
            cls.at = time.monotonic()

    @classmethod
    def expired(cls) -> bool:
        return cls.at is not None and time.monotonic() - cls.at > _STOP_GRACE_S


def _import_engine() -> tuple[Any, Exception | None]:
    """The engine's factory (factory.py), or why it would not import (a broken install): raised
    once the output sockets exist, so the API process prints the reason, not only an exit code."""
    try:
        from ketch.engine.factory import make_engine
    except Exception as e:
        return None, e
    return make_engine, None


def run_engine(config: EngineConfig, eos_in: Connection, input_addrs: list[str],
               output_addrs: list[str], parent_pid: int) -> None:
    _StopSignal.install()
    make_engine, import_error = _import_engine()  # (overlaps the API process's tokenizer load)
    try:
        eos_token_ids = tuple(eos_in.recv())
    except EOFError:  # the API process gave up before the engine was built (a bad tokenizer, a signal)
        return
    finally:
        eos_in.close()
    zctx = zmq.Context()
    inbox = zctx.socket(zmq.PULL)
    for addr in input_addrs:  # the receiver binds (EngineClient._link says why)
        inbox.bind(addr)
    outboxes = Outboxes.connect(zctx, output_addrs)
    progress, stop = _Progress(), threading.Event()
    beat = threading.Thread(target=_beat, args=(zctx, output_addrs, progress, stop), name="ketch-heartbeat",
                            daemon=True)
    code, ready = 0, False
    try:
        if import_error is not None:  # reported as any start-up failure: EngineError, exit 1
            raise import_error
        engine = make_engine(config, eos_token_ids)
        # Everything built so far (torch, the model's modules, graphs) lives as long as the
        # process: keep it out of the cyclic GC, whose full passes over it stalled the GPU
        # ~0.15 s each in long runs.
        gc.freeze()
        capacity = engine.runner.pool.num_pages * config.page_size
        outboxes.send_all(m.EngineReady(engine.max_model_len, engine.vocab_size, capacity, new_instance_id()))
        ready = True
        beat.start()  # after EngineReady: start-up has its own deadline in the API process
        _loop(engine, inbox, outboxes, parent_pid, progress)
        engine.close()
    except Exception as e:
        setting = isinstance(e, ValueError) and not ready  # the build's checks name the setting
        if not setting:
            traceback.print_exc()
        outboxes.send_all(m.EngineError(str(e) if setting else f"{type(e).__name__}: {e}", setting))
        code = 1
    stop.set()
    if beat.is_alive():
        beat.join()
    outboxes.close()
    inbox.close()
    zctx.term()
    if code:
        sys.exit(code)


def _loop(engine, inbox: zmq.Socket, outboxes: Outboxes, parent_pid: int, progress: _Progress) -> None:
    while True:
        if os.getppid() != parent_pid:  # orphaned: the API process is gone, and nobody reads our work
            return
        if _StopSignal.expired():  # signalled, and no Shutdown came in the grace period
            return
        busy = progress.busy = engine.has_unfinished()
        if not busy and not inbox.poll(_IDLE_POLL_MS):
            outboxes.forget_unless(engine.requests)
            engine.audit_if_due()
            continue
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
                outboxes.send_to(m.origin_of(data), reply)
                continue
            if isinstance(msg, m.Shutdown):
                return
            reply = _handle(engine, msg)
            if reply is not None:
                outboxes.send_to(msg.origin, reply)  # only requests, pings and flushes are answered: each names it
            elif isinstance(msg, m.GenerateRequest):
                outboxes.owned(msg.request_id, msg.origin)
        if engine.has_unfinished():
            progress.busy = True
            outputs = engine.step()
            progress.steps += 1
            if outputs:
                outboxes.send_outputs([m.TokenDelta.from_output(o) for o in outputs], engine.requests)


def _handle(engine, msg: m.ToEngine) -> m.FromEngine | None:
    if isinstance(msg, m.GenerateRequest):
        try:
            engine.add_request(msg.request_id, msg.prompt_ids, msg.params.to_params(), msg.generated_token_ids,
                               msg.bootstrap)
        except ValueError as e:
            return m.RequestError(msg.request_id, str(e))
    elif isinstance(msg, m.AbortRequest):
        engine.abort(msg.request_id, msg.index)
    elif isinstance(msg, m.Ping):
        return m.Pong(msg.nonce, engine.stats())
    elif isinstance(msg, m.FlushCache):
        # between steps, like every message: no step is half-way through the pages it uses
        freed = engine.flush_cache()
        return m.CacheFlushed(msg.nonce, freed["device"], freed.get("host", 0))
    return None
