"""`ketch gateway`: build the gateway, serve it with uvicorn until SIGTERM / Ctrl-C.

On SIGTERM uvicorn stops accepting connections and gives open requests (streams included)
`--shutdown-timeout` seconds to finish; those still open then end with a `server_shutdown` answer
(an error event and [DONE] on a stream, a 503 if nothing was sent: generate.py), uvicorn's own
deadline a little later; then the background loops stop and the connection pool closes (the
lifespan's exit). The exit code is 0 after such a shutdown, 1 if the gateway never started.
"""
from __future__ import annotations

import gc
import logging
import sys
from typing import Any

from ketch.gateway.app import FrontDoor, build_app
from ketch.gateway.config import GatewayConfig
from ketch.gateway.gateway import Gateway
from ketch.http_shutdown import GracefulServer


class _GatewayServer(GracefulServer):
    def __init__(self, front: FrontDoor, deadline_s: float, **config: Any) -> None:
        super().__init__(front, deadline_s, **config)
        self.front = front

    def at_deadline(self) -> None:
        self.front.generation.cut_open()


def run(config: GatewayConfig) -> int:
    gateway = Gateway(config)  # ValueError for a bad worker URL: the CLI prints it, exit 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    front = build_app(gateway)
    server = _GatewayServer(
        front, config.shutdown_timeout, host=config.host, port=config.port, log_level="warning", lifespan="on",
        http="httptools")  # relay.py writes stream events on its transport directly (client_stream.py)
    workers = (f"PD: {len(config.prefill_workers)} prefill, {len(config.decode_urls)} decode workers"
               if config.pd_disaggregation else f"{len(config.worker_urls)} workers")
    print(f"ketch gateway on http://{config.host}:{config.port} ({config.policy}, {workers})", file=sys.stderr,
          flush=True)
    # Relaying allocates a few small objects per SSE event, none of them in a cycle, and the
    # default collector then runs a young-generation pass every 700 of them. Start-up objects
    # (modules, the app) are frozen out of every pass, and passes come every 20,000: ~15 % less
    # gateway CPU at 64 streams (docs/performance.md, "Gateway overhead").
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    server.run()
    return 0 if server.started else 1  # not started: the port was taken, or the lifespan failed
