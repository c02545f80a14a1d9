"""What both nixl sides need from NIXL: an agent with the pool registered, and descriptor lists
of page rows. NIXL is optional (`pip install nixl`): it is imported when a nixl transport is made.

A row is page p of one (layer, tensor): page_size x row shape elements, contiguous at
base + p * row_bytes (the pool is [pages, page_size, *row shape], contiguous; layout.py checks).
A transfer's descriptors go (layer, tensor)-major, pages in the transfer's order, on both sides
alike, so descriptor i of the decode side's list receives descriptor i of the prefill side's.
The transport chooses no UCX transport: set UCX_TLS in the environment (tests: UCX_TLS=tcp).
"""
from __future__ import annotations

import os
import uuid

import numpy as np
import torch

from ketch.disagg.layout import KVLayout
from ketch.disagg.wire import NixlPeer


def new_agent(role: str) -> object:
    """A NIXL agent with the UCX backend, named uniquely (a restarted process is another agent)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise RuntimeError("transfer_backend 'nixl' needs the nixl package (pip install nixl)") from e
    return nixl_agent(f"ketch-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))


def pool_tensors(layers: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t for layer in layers for t in layer.values()]


def mem_type_of(layers: list[dict[str, torch.Tensor]]) -> tuple[str, int]:
    device = next(iter(layers[0].values())).device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def describe(agent: object, layers: list[dict[str, torch.Tensor]]) -> NixlPeer:
    """What a decode side needs to READ from this (prefill) agent's registered pool."""
    mem_type, device_id = mem_type_of(layers)
    return NixlPeer(agent.name, agent.get_agent_metadata(), [t.data_ptr() for t in pool_tensors(layers)],
                    mem_type, device_id)


def row_descs(layout: KVLayout, bases: list[int], pages: list[int], device_id: int) -> np.ndarray:
    """[layers x tensors x pages, 3] rows of (address, bytes, device id), in transfer order."""
    row_bytes = np.array([layout.page_size * t.page_bytes_per_token for t in layout.tensors] * layout.num_layers,
                         dtype=np.int64)
    base = np.asarray(bases, dtype=np.int64)
    page = np.asarray(pages, dtype=np.int64)
    addrs = base[:, None] + page[None, :] * row_bytes[:, None]
    lens = np.broadcast_to(row_bytes[:, None], addrs.shape)
    return np.stack([addrs.ravel(), lens.ravel(), np.full(addrs.size, device_id, dtype=np.int64)], axis=1)
