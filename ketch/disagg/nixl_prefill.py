"""The nixl backend, prefill side: the pool is registered with a NIXL agent and described in
every Welcome; `send` becomes Ready(src pages, Aux) and the decode side READs the rows itself.

From the Ready on, the decode side may be reading the pages without this side knowing, so a
failure here waits for its word (prefill_side.py, "peer_reads"): the pages are not handed back
to the engine while a READ may still take them. The control plane is prefill_side.py's.
"""
from __future__ import annotations

import torch

from ketch.disagg.config import DisaggConfig
from ketch.disagg.nixl_agent import describe, new_agent, pool_tensors
from ketch.disagg.prefill_sender import PrefillSender, Registration
from ketch.disagg.prefill_side import PrefillSide
from ketch.disagg.wire import Welcome


class NixlPrefillTransport(PrefillSide):
    backend = "nixl"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        super().__init__(config, layers, model)
        self.agent = new_agent("prefill")
        self.registered = self.agent.register_memory(pool_tensors(layers))
        self.peer_info = describe(self.agent, layers)
        self.start()

    def _welcome(self, room: int) -> Welcome:
        return Welcome(room, self.peer_info)

    def _start(self, s: PrefillSender, reg: Registration) -> None:
        self._start_peer_read(s, reg)

    def _grow(self, s: PrefillSender) -> None:
        self._grow_peer_read(s)

    def close(self) -> None:
        super().close()
        if self.registered is not None:  # once: close may be called again
            self.agent.deregister_memory(self.registered)
            self.registered = None
