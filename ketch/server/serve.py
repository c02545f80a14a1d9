"""`ketch serve`: load the tokenizer, start the engine process, wait for it, then serve HTTP.

The exit code is 0 after a normal shutdown (Ctrl-C / SIGTERM) and 1 when the engine process died
(or never became ready): a supervisor should restart a server whose engine is gone.
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
from ketch.server.state import Admission, ServerState
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable
from ketch.weights.source import default_model_path, detect_format


class _Server(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM/SIGINT ends in a clean return (exit code 0) instead
    of being raised again after the graceful shutdown, which would kill the process before the
    engine is stopped."""

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
    path = config.model or default_model_path()
    if detect_format(path, config.load_format) == "dummy":
        return None
    try:
        return Tokenizer.load(path)
    except TokenizerUnavailable:
        return None


async def serve(config: EngineConfig, server_config: ServerConfig) -> int:
    sc = server_config
    tokenizer = _load_tokenizer(config)
    template_src = sc.chat_template or (tokenizer.chat_template if tokenizer else None)
    template = ChatTemplate(template_src) if template_src else None
    client = EngineClient(config, tokenizer.eos_token_ids if tokenizer else ())
    try:
        ready = await client.start()
    except EngineStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    name = sc.served_model_name or os.path.basename((config.model or default_model_path()).rstrip("/"))
    limit = None if sc.max_queued_requests is None else config.max_num_seqs + sc.max_queued_requests
    state = ServerState(client, tokenizer, template, name, sc.api_key, Admission(limit),
                        tool_call_parser=sc.tool_call_parser, reasoning_parser=sc.reasoning_parser)
    # SIGTERM (uvicorn's handler): stop accepting, give in-flight requests `shutdown_timeout`
    # seconds to finish, cancel the rest (their samples are aborted), then stop the engine.
    server = _Server(uvicorn.Config(build_app(state, sc.max_request_bytes), host=sc.host, port=sc.port,
                                           log_level="warning", timeout_graceful_shutdown=sc.shutdown_timeout))
    client.on_death = lambda: setattr(server, "should_exit", True)
    print(f"ketch: serving {name} (context {ready.max_model_len}) on http://{sc.host}:{sc.port}", flush=True)
    try:
        await server.serve()
    finally:
        died = not client.alive and client.exitcode not in (None, 0)
        client.close()
    if died:
        print(f"error: the engine process exited (code {client.exitcode})", file=sys.stderr)
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
