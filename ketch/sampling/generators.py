"""Random generators: one per seeded request, one shared per device for unseeded ones."""
from __future__ import annotations

import os

import torch


def fresh_seed() -> int:
    """63 bits of OS randomness (fits every backend's manual_seed)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A request's own generator: from `seed`, or from fresh OS randomness when None."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(fresh_seed() if seed is None else seed)
    return generator


_SHARED: dict[torch.device, torch.Generator] = {}


def shared_generator(device: torch.device) -> torch.Generator:
    """What rows without a generator draw from, one per device. Seeded from OS randomness
    because torch's default generators start from a fixed seed: every restart would repeat."""
    if device not in _SHARED:
        _SHARED[device] = make_generator(None, device)
    return _SHARED[device]
