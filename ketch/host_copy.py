"""Host → device copies that never wait for the device.

`torch.tensor(data, device="cuda")` (and `.to("cuda")` from pageable memory) copies and then
synchronizes the stream: the host stops until every kernel queued before it has run. With
overlap scheduling the host builds step N+1 while step N runs, so one such copy would put the
whole step back on the critical path. Here the data goes through pinned memory with a
non-blocking copy instead; torch's pinned-memory cache keeps the buffer alive until the copy
has happened. Off CUDA it is a plain tensor.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(data: Sequence | np.ndarray | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`data` (a list, a numpy array or a CPU tensor) as a tensor on `device`, without a sync."""
    if isinstance(data, torch.Tensor):
        host = data if dtype is None else data.to(dtype)
    elif isinstance(data, np.ndarray):
        host = torch.from_numpy(data) if dtype is None else torch.from_numpy(data).to(dtype)
    else:
        host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
