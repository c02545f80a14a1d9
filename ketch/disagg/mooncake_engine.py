"""What both mooncake sides need from the Mooncake transfer engine (PyPI
`mooncake-transfer-engine` / `-non-cuda`, module `mooncake.engine`): an engine on the TCP
transport with the P2P handshake (no etcd, no metadata server: a peer is named by the address of
its engine's RPC port, "host:port"), the pool registered, and a READ's entries.

Facts of the installed wheel (0.3.13.post1) this relies on, found by trying them:
- `initialize(host, "P2PHANDSHAKE", "tcp", "")` returns 0; `get_rpc_port()` is the port the
  engine chose; the session a peer READs from is f"{host}:{rpc_port}".
- `batch_transfer_sync_read(session, local, remote, lengths)` blocks (the GIL released) until the
  READ is over: 0 done, -1 failed. It cannot be cancelled. It gives up after MC_TRANSFER_TIMEOUT
  seconds (30 by default, 5 at least) plus 1 ns a byte, but the first READ from a peer first
  opens its segment (the handshake), and towards a stopped peer that took 62 s before -1.
- The serving side refuses addresses outside its registered memory; the local buffer of a READ
  need not be registered (tcp transport).
- The non-CUDA wheel moves host memory only (`mooncake.engine.SUPPORT_CUDA` is False): its tcp
  server would read a device pointer as a host one.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from ketch.config import WILDCARD_HOSTS
from ketch.disagg.layout import KVLayout


def new_engine(host: str) -> tuple[object, str]:
    """A started engine and its session name; RuntimeError naming transfer_backend when the
    package is missing or the engine does not start."""
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as e:  # OSError: a shared library the extension needs is missing
        raise RuntimeError("transfer_backend 'mooncake' needs the Mooncake transfer engine "
                           f"(pip install mooncake-transfer-engine-non-cuda): {e}") from e
    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"transfer_backend 'mooncake': the transfer engine did not start on {host!r}")
    return engine, f"{host}:{engine.get_rpc_port()}"


def local_host(bind_host: str) -> str:
    """The address a peer reaches this engine at: the bootstrap host, unless that is a wildcard."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def cuda_supported() -> bool:
    from mooncake import engine
    return bool(getattr(engine, "SUPPORT_CUDA", False))


def pool_tensors(layers: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Layer-major, each layer's dict order: the order of bases and of a READ's entries."""
    return [t for layer in layers for t in layer.values()]


def register_pool(engine: object, tensors: list[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if engine.register_memory(t.data_ptr(), t.numel() * t.element_size()) != 0:
            unregister_pool(engine, tensors[:i])
            raise RuntimeError(f"transfer_backend 'mooncake': registering pool tensor {i} "
                               f"({t.numel() * t.element_size()} bytes) failed")


def unregister_pool(engine: object, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        engine.unregister_memory(t.data_ptr())


@dataclass(frozen=True)
class ReadPlan:
    """One room's READ into a staging buffer: the rows of tensor j (layout order) for the
    room's pages, in the room's page order, at offsets[j]; one entry per run of consecutive
    source pages per tensor."""

    row_bytes: list[int]  # per tensor
    offsets: list[int]  # where tensor j's rows start in the staging buffer
    total: int  # the staging buffer's size
    local: list[int]  # entry offsets into the staging buffer
    remote: list[int]  # entry addresses at the prefill side
    lengths: list[int]


def read_plan(layout: KVLayout, remote_bases: list[int], src_pages: list[int]) -> ReadPlan:
    runs: list[tuple[int, int, int]] = []  # (index into the room's pages, first source page, count)
    for i, page in enumerate(src_pages):
        if runs and page == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, page, 1))
    row_bytes = [layout.page_size * t.page_bytes_per_token for t in layout.tensors] * layout.num_layers
    offsets, local, remote, lengths = [], [], [], []
    offset = 0
    for base, row in zip(remote_bases, row_bytes, strict=True):
        offsets.append(offset)
        for index, first, count in runs:
            local.append(offset + index * row)
            remote.append(base + first * row)
            lengths.append(count * row)
        offset += len(src_pages) * row
    return ReadPlan(row_bytes, offsets, offset, local, remote, lengths)


def staged_rows(plan: ReadPlan, staging: torch.Tensor, j: int, like: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Tensor j's rows in the staging buffer, shaped and typed as the pool tensor `like`."""
    rows = staging[plan.offsets[j]:plan.offsets[j] + num_pages * plan.row_bytes[j]]
    return rows.view(like.dtype).view(num_pages, *like.shape[1:])
