"""`ketch serve`: load the tokenizer, start the engine process, wait for it, then serve HTTP.

The exit code is 0 after a normal shutdown (Ctrl-C / SIGTERM) and 1 when the engine process died,
hung (the watchdog) or never became ready: a supervisor should restart a server whose engine is gone.

SIGTERM: stop accepting, give in-flight requests `shutdown_timeout` seconds, then end those still
running with a `server_shutdown` error (an error event and [DONE] on a stream, a 503 otherwise);
uvicorn's own deadline comes a little later, so those answers are written before it cancels tasks.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

import uvicorn

from ketch.config import EngineConfig
from ketch.server.app import build_app
from ketch.server.client import EngineClient, EngineStartError
from ketch.server.config import ServerConfig
from ketch.server.errors import server_shutdown
from ketch.server.front_door import FrontDoor
from ketch.server.http_protocol import GuardedHttpProtocol
from ketch.server.state import Admission, ServerState
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable
from ketch.weights.source import ModelSource, default_model_path


_ANSWER_GRACE_S = 5.0  # after our deadline, time for the shutdown answers to leave before uvicorn cancels


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT ends in a clean return (exit code 0) instead
    of being raised again after the graceful shutdown, which would kill the process before the
    engine is stopped; and that requests still running at our deadline get a proper answer."""

    state: ServerState | None = None
    deadline_s: float = 30.0

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        if self.state is not None:
            self.state.shutting_down = True
            asyncio.get_running_loop().call_later(self.deadline_s, self.state.client.broadcast, server_shutdown())
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    source = ModelSource.resolve(config.model, config.load_format, config.tokenizer).tokenizer
    if source is None:
        return None
    try:
        return Tokenizer.load(source)
    except TokenizerUnavailable:
        if config.tokenizer is not None:
            raise ValueError(f"tokenizer: no tokenizer found in {config.tokenizer!r}") from None
        return None


async def serve(config: EngineConfig, server_config: ServerConfig) -> int:
    sc = server_config
    tokenizer = _load_tokenizer(config)
    template_src = sc.chat_template or (tokenizer.chat_template if tokenizer else None)
    template = ChatTemplate(template_src) if template_src else None
    client = EngineClient(config, tokenizer.eos_token_ids if tokenizer else (), sc.watchdog_timeout)
    try:
        ready = await client.start()
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    name = sc.served_model_name or os.path.basename((config.model or default_model_path()).rstrip("/"))
    limit = None if sc.max_queued_requests is None else config.max_num_seqs + sc.max_queued_requests
    state = ServerState(client, tokenizer, template, name, sc.api_key, Admission(limit),
                        tool_call_parser=sc.tool_call_parser, reasoning_parser=sc.reasoning_parser,
                        max_n=sc.max_n, request_timeout=sc.request_timeout)
    app = FrontDoor(build_app(state, sc.max_request_bytes, sc.body_timeout), state)
    protocol = GuardedHttpProtocol.with_limits(sc.header_timeout, sc.max_connections)
    server = _Server(uvicorn.Config(app, host=sc.host, port=sc.port, http=protocol, log_level="warning",
                                    timeout_graceful_shutdown=sc.shutdown_timeout + _ANSWER_GRACE_S))
    server.state, server.deadline_s = state, sc.shutdown_timeout
    client.on_death = lambda: setattr(server, "should_exit", True)
    print(f"ketch: serving {name} (context {ready.max_model_len}) on http://{sc.host}:{sc.port}", flush=True)
    try:
        await server.serve()
    finally:
        failure = client.failure  # set when the engine died or hung; a clean stop leaves it None
        client.close()
    if failure is not None:
        print(f"error: {failure}", file=sys.stderr)
        return 1
    print("ketch: shut down", flush=True)
    return 0


def read_chat_template(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"chat_template: cannot read {path!r} ({e.strerror})") from None


def run(config: EngineConfig, server_config: ServerConfig) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(config, server_config))
    return uvloop.run(serve(config, server_config))
