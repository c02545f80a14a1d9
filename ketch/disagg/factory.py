"""The one place that picks a transport for a DisaggConfig (the engine calls it once, at init)."""
from __future__ import annotations

import torch

from ketch.disagg.config import DisaggConfig
from ketch.disagg.fake import FakeHub, FakeTransport
from ketch.disagg.transport import KVTransport


def make_transport(config: DisaggConfig, layers: list[dict[str, torch.Tensor]], model: str = "",
                   hub: FakeHub | None = None) -> KVTransport:
    """layers: the device pool's tensors (`KVPool.layers`); model: its fingerprint, so that pages
    of another model are refused; hub: fake backend only, pairs a prefill and a decode transport
    of one process (None: a lone fake side, for warm-up)."""
    if config.transfer_backend == "fake":
        return FakeTransport(config, hub)
    if config.transfer_backend == "tcp":
        if config.mode == "prefill":
            from ketch.disagg.tcp_prefill import TcpPrefillTransport
            return TcpPrefillTransport(config, layers, model)
        from ketch.disagg.tcp_decode import TcpDecodeTransport
        return TcpDecodeTransport(config, layers, model)
    if config.transfer_backend == "nixl":
        if config.mode == "prefill":
            from ketch.disagg.nixl_prefill import NixlPrefillTransport
            return NixlPrefillTransport(config, layers, model)
        from ketch.disagg.nixl_decode import NixlDecodeTransport
        return NixlDecodeTransport(config, layers, model)
    if config.transfer_backend == "mooncake":
        if config.mode == "prefill":
            from ketch.disagg.mooncake_prefill import MooncakePrefillTransport
            return MooncakePrefillTransport(config, layers, model)
        from ketch.disagg.mooncake_decode import MooncakeDecodeTransport
        return MooncakeDecodeTransport(config, layers, model)
    raise ValueError(f"transfer_backend: {config.transfer_backend!r} has no transport yet")
