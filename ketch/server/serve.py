"""`ketch serve`: start the engine process, load the tokenizer meanwhile, hand the engine its EOS ids,
wait for it, then serve HTTP.

The exit code is 0 after a normal shutdown (Ctrl-C / SIGTERM) and 1 when the engine process died,
hung (the watchdog) or never became ready: a supervisor should restart a server whose engine is gone.

`--api-server-count N`: this process starts the engine and N - 1 more API processes
(api_workers.py), all serving the same port through SO_REUSEPORT sockets; one of them dying takes
the server down (exit 1), as the engine dying does.

SIGTERM: stop accepting, give in-flight requests `shutdown_timeout` seconds, then end those still
running with a `server_shutdown` error (an error event and [DONE] on a stream, a 503 otherwise);
uvicorn's own deadline comes a little later, so those answers are written before it cancels tasks.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from typing import Callable

from ketch.config import WILDCARD_HOSTS, EngineConfig
from ketch.http_shutdown import ANSWER_GRACE_S, GracefulServer
from ketch.instance_id import HEADER as INSTANCE_HEADER
from ketch.server.api_workers import ApiWorkerError, ApiWorkers, bound_socket, shared_metrics_dir, start_listening
from ketch.server.app import build_app
from ketch.server.client import EngineClient, EngineStartError
from ketch.server.config import ServerConfig
from ketch.server.errors import server_shutdown
from ketch.server.front_door import FrontDoor
from ketch.server.http_protocol import GuardedHttpProtocol
from ketch.server.metrics import ServerMetrics
from ketch.server.state import Admission, ServerState
from ketch.text.chat_template import ChatTemplate
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable
from ketch.weights.source import ModelSource, default_model_path


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


def check_bootstrap_port(config: EngineConfig, sc: ServerConfig) -> None:
    """A prefill server's bootstrap socket (the engine's) and its HTTP socket cannot share an address."""
    host, port = config.disaggregation_bootstrap_host, config.disaggregation_bootstrap_port
    overlap = host == sc.host or host in WILDCARD_HOSTS or sc.host in WILDCARD_HOSTS
    if config.disaggregation_mode == "prefill" and port == sc.port != 0 and overlap:
        raise ValueError(f"disaggregation_bootstrap_port: {port} is this server's HTTP port too (--port): "
                         f"the bootstrap socket needs a port of its own")


async def serve(config: EngineConfig, server_config: ServerConfig) -> int:
    sc = server_config
    check_bootstrap_port(config, sc)
    many = sc.api_server_count > 1
    workdir = tempfile.mkdtemp(prefix="ketch-") if many else None
    sock = bound_socket(sc.host, sc.port, shared=many)  # bound first: port 0 picks one port for all
    port = sock.getsockname()[1]
    metrics_dir = shared_metrics_dir(workdir) if workdir else None
    client = EngineClient(config, (), sc.watchdog_timeout, workdir=workdir)
    workers: ApiWorkers | None = None
    try:
        # the engine process first: its imports (~2 s) run while this process loads the tokenizer
        client.launch(api_servers=sc.api_server_count)
        tokenizer = _load_tokenizer(config)
        try:
            ready = await client.start(tokenizer.eos_token_ids if tokenizer else ())
            if many:
                workers = ApiWorkers.start(config, sc, workdir, client.engine_pid, port)
                await workers.wait_ready()
        except (EngineStartError, ApiWorkerError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        server = http_server(config, sc, client, tokenizer, metrics_dir)
        start_listening(sock, sc.host, port, server.config.backlog)
        if workers is not None:
            workers.on_death = lambda reason: (setattr(server, "should_exit", True), setattr(workers, "failure", reason))
            server.on_shutdown = workers.signal_stop
        name = server.state.model_name
        count = f" ({sc.api_server_count} API processes)" if many else ""
        print(f"ketch: serving {name} (context {ready.max_model_len}) on http://{sc.host}:{port}{count}", flush=True)
        await server.serve(sockets=[sock])
    finally:
        if workers is not None:
            workers.stop(sc.shutdown_timeout + 2 * ANSWER_GRACE_S)
        failure = client.failure or (workers.failure if workers is not None else None)
        client.close()
        sock.close()  # (bound before the tokenizer loaded: an error there must not leak it)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
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
