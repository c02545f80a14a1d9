"""The host tier's "kernel" IO backend: page-copy kernels between the device pool and the pinned
host pool as the GPU addresses it (`EngineConfig.hicache_io_backend="kernel"`).

    device pool  layers[l][name]  ◀── copy_pages (load) ──  mapped host pool  layers[l][name]
                                  ─── copy_pages (save) ──▶  (pinned; host_mapping.py)

The loader (layer_loader.py) and the saver (host_saver.py) own the stream order; this only
uploads a copy's page ids (one small DMA) and launches one kernel per layer and tensor on the
current stream (their copy stream). The pinned pool is mapped once, here, at init, and every
kernel variant the copies need is compiled here too (a first load must not compile mid-run): each
host page 0 is copied onto itself through the mapping, which also proves the mapping works
before the first request needs it. On the CPU nothing is mapped: the host layers are used as they
are, which is how the CPU tests run these plans under Triton's interpreter.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ketch.cache.host_mapping import map_layers
from ketch.host_copy import to_device


class KernelIO:
    def __init__(self, host_layers: list[dict[str, torch.Tensor]], device_layers: list[dict[str, torch.Tensor]],
                 device: torch.device) -> None:
        from ketch.kernels.page_copy import copy_pages  # triton: imported only where this backend is chosen

        self.copy_pages = copy_pages
        self.device_layers, self.device = device_layers, device
        self.host_layers = map_layers(host_layers, device) if device.type == "cuda" else host_layers
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the variants loads and saves use (same word type, row length and alignments:
        the device pool's rows are the host pool's) by copying each host page 0 onto itself."""
        zero, _ = self.page_ids([0], [0])
        for layer in self.host_layers:
            for h in layer.values():
                self.copy_pages(h, h, zero, zero)

    def page_ids(self, src_pages: Sequence[int], dst_pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Both lists on the device in one upload (call it on the stream the kernels run on: the
        ids are then allocated and freed in that stream's order), as its two halves."""
        ids = to_device([*src_pages, *dst_pages], self.device, torch.int32)
        return ids[:len(src_pages)], ids[len(src_pages):]

    def load_layer(self, layer: int, host_ids: torch.Tensor, device_ids: torch.Tensor) -> None:
        """host rows → device rows, every tensor of one layer."""
        dev = self.device_layers[layer]
        for name, h in self.host_layers[layer].items():
            self.copy_pages(h, dev[name], host_ids, device_ids)

    def save_layer(self, layer: int, device_ids: torch.Tensor, host_ids: torch.Tensor) -> None:
        """device rows → host rows, every tensor of one layer (the kernel writes host memory)."""
        dev = self.device_layers[layer]
        for name, h in self.host_layers[layer].items():
            self.copy_pages(dev[name], h, device_ids, host_ids)
