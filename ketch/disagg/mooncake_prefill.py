"""The mooncake backend, prefill side: the pool is registered with a Mooncake transfer engine
(tcp transport, P2P handshake) and named in every Welcome; `send` becomes Ready(src pages, Aux)
and the decode side READs the rows itself (mooncake_decode.py says why this direction).

From the Ready on, the decode side may be reading the pages without this side knowing, so a
failure here waits for its word (prefill_side.py, "peer_reads"), exactly as nixl: the decode
side sends Released / Abort only once its READ is over. The control plane is prefill_side.py's.
"""
from __future__ import annotations

import torch

from ketch.disagg.config import DisaggConfig
from ketch.disagg.mooncake_engine import (cuda_supported, local_host, new_engine, pool_tensors, register_pool,
                                          unregister_pool)
from ketch.disagg.prefill_sender import PrefillSender, Registration
from ketch.disagg.prefill_side import PrefillSide
from ketch.disagg.wire import MooncakePeer, Welcome


class MooncakePrefillTransport(PrefillSide):
    backend = "mooncake"

    def __init__(self, config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "") -> None:
        engine, session = new_engine(local_host(config.bootstrap_host))  # first: a missing package says so at once
        tensors = pool_tensors(layers)
        if tensors and tensors[0].device.type != "cpu" and not cuda_supported():
            raise RuntimeError(f"transfer_backend 'mooncake': the installed transfer engine moves host memory only "
                               f"and the pool is on {tensors[0].device} (install a CUDA build of mooncake)")
        super().__init__(config, layers, model)
        self.engine = engine
        self.tensors = tensors
        register_pool(engine, tensors)
        self.peer_info = MooncakePeer(session, [t.data_ptr() for t in tensors])
        self.start()

    def _welcome(self, room: int) -> Welcome:
        return Welcome(room, mooncake=self.peer_info)

    def _start(self, s: PrefillSender, reg: Registration) -> None:
        self._start_peer_read(s, reg)

    def _grow(self, s: PrefillSender) -> None:
        self._grow_peer_read(s)

    def close(self) -> None:
        super().close()
        if self.tensors:  # once: close may be called again. From here on its engine serves no READ of the pool
            unregister_pool(self.engine, self.tensors)
            self.tensors = []
