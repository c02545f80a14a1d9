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
import shutil
import sys
import tempfile

from ketch.config import WILDCARD_HOSTS, EngineConfig
from ketch.http_shutdown import ANSWER_GRACE_S
from ketch.server.api_workers import ApiWorkerError, ApiWorkers, bound_socket, shared_metrics_dir, start_listening
from ketch.server.client import EngineClient, EngineStartError
from ketch.server.config import ServerConfig
from ketch.text.tokenizer import Tokenizer, TokenizerUnavailable
from ketch.weights.source import ModelSource

# Nothing imported above may import torch, fastapi or transformers: this process launches the
# engine process first and hands it the tokenizer's EOS ids as soon as it can, and a second spent
# on imports before either is a second of start-up (tests/test_serve_startup.py holds it to that).


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    source = ModelSource.resolve(config.model, config.load_format, config.tokenizer).tokenizer
    if source is None:
        return None
    try:
        return Tokenizer.load(source)
    except TokenizerUnavailable:
        if config.tokenizer is not None:
            raise ValueError(f"tokenizer: no tokenizer found in {config.tokenizer!r}") from None
        return None


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
        # the engine process first: it imports torch and its modules while this process loads the
        # tokenizer, then builds (weights, KV pool) while this one imports the web stack
        client.launch(api_servers=sc.api_server_count)
        tokenizer = load_tokenizer(config)
        try:
            client.hand_eos(tokenizer.eos_token_ids if tokenizer else ())
            from ketch.server.http_server import http_server

            ready = await client.start()
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
