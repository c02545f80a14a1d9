"""Random weights of a model's real shapes: for benchmarks and tests without a checkpoint.

Each tensor draws from its own generator seeded by (seed, name), so a tensor's values do not
depend on which other tensors were generated before it, and nothing is held beyond the one being
yielded. Values are drawn directly in the target dtype on the target device (no float32 copy);
they are reproducible for a given seed, dtype and device type.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch


_STD = 0.02  # the usual initializer_range of HF decoders: keeps activations in a sane range


def tensor_seed(seed: int, name: str) -> int:
    # crc32, not hash(): Python salts str hashes per process.
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


class DummyWeights:
    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, seed: int = 0,
        device: torch.device | str = "cpu", fp32: tuple[str, ...] = (),
    ) -> None:
        """shapes: name -> shape of every tensor to draw (the family's `weight_shapes`); names
        ending in one of `fp32` are drawn in float32, not `dtype`."""
        self.shapes = dict(shapes)
        self.dtype, self.fp32 = dtype, fp32
        self.seed = seed
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.shapes)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in self.shapes.items():
            yield name, self.make(name, shape)

    def make(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        dtype = torch.float32 if name.endswith(self.fp32) else self.dtype
        if name.endswith(".bias"):
            return torch.zeros(shape, dtype=dtype, device=self.device)
        if len(shape) == 1:  # RMSNorm scales: identity at init
            return torch.ones(shape, dtype=dtype, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
        return torch.empty(shape, dtype=dtype, device=self.device).normal_(0.0, _STD, generator=gen)
