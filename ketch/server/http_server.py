"""The HTTP side of one API process: its uvicorn server.

A module of its own so that `ketch serve` (serve.py) imports it only after it has handed the
engine process the tokenizer's EOS ids: the web stack takes ~0.7 s to import, which the engine's
build (weights, KV pool) runs beside instead of after.
"""
from __future__ import annotations

import os
from typing import Callable

from ketch.config import EngineConfig
from ketch.http_shutdown import GracefulServer
from ketch.instance_id import HEADER as INSTANCE_HEADER
from ketch.server.app import build_app
from ketch.server.client import EngineClient
from ketch.server.config import ServerConfig
from ketch.server.errors import server_shutdown
from ketch.server.front_door import FrontDoor
from ketch.server.http_protocol import GuardedHttpProtocol
from ketch.server.metrics import ServerMetrics
from ketch.server.state import Admission, ServerState
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer
from ketch.weights.source import default_model_path


class _Server(GracefulServer):
    """Requests still running at our deadline end with `server_shutdown`; new ones are turned
    away from the signal on (`state.shutting_down`)."""

    state: ServerState | None = None
    on_shutdown: Callable[[], None] | None = None  # the other API processes stop alongside (api_workers)

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        if self.state is not None:
            self.state.shutting_down = True
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)

    def at_deadline(self) -> None:
        if self.state is not None:
            self.state.client.broadcast(server_shutdown())


def http_server(config: EngineConfig, sc: ServerConfig, client: EngineClient, tokenizer: Tokenizer | None,
                metrics_dir: str | None = None) -> _Server:
    """The uvicorn server of one API process (each of `api_server_count` builds its own)."""
    share = sc.api_server_count  # the queue and connection limits are split between the API processes
    template_src = sc.chat_template or (tokenizer.chat_template if tokenizer else None)
    template = ChatTemplate(template_src) if template_src else None
    name = sc.served_model_name or os.path.basename((config.model or default_model_path()).rstrip("/"))
    limit = None if sc.max_queued_requests is None else -(-(config.max_num_seqs + sc.max_queued_requests) // share)
    state = ServerState(client, tokenizer, template, name, sc.api_key, Admission(limit),
                        tool_call_parser=sc.tool_call_parser, reasoning_parser=sc.reasoning_parser,
                        max_n=sc.max_n, max_request_samples=sc.max_request_samples,
                        request_timeout=sc.request_timeout, metrics=ServerMetrics(metrics_dir))
    which = ((b"x-ketch-api-process", str(client.origin).encode()),) if share > 1 else ()
    assert client.ready is not None  # started or attached: the engine's EngineReady came
    which += ((INSTANCE_HEADER, client.ready.instance_id.encode()),)  # which server answered: instance_id.py
    app = FrontDoor(build_app(state, sc.max_request_bytes, sc.body_timeout), state, which)
    connections = None if sc.max_connections is None else -(-sc.max_connections // share)
    protocol = GuardedHttpProtocol.with_limits(sc.header_timeout, connections, sc.max_header_bytes)
    server = _Server(app, sc.shutdown_timeout, host=sc.host, port=sc.port, http=protocol, log_level="warning")
    server.state = state
    client.on_death = lambda: setattr(server, "should_exit", True)
    return server
