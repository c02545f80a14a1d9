"""The rotary tables a model gathers once per step: cos and signed sin rows by position.

Both rotary kinds here (layers/rotary.py, layers/yarn.py) tabulate full-width fp32 cos / sin for
every position, and a step gathers its tokens' rows in the activation dtype. Gathering from fp32
tables and then casting took six launches a step on CUDA (the positions widened to int64 for each
advanced index, two gathers, two casts); a decode CUDA graph of a MoE model at batch 1 spent
~10 µs of its ~1.9 ms step on them on the H200. The tables are cast once per (dtype, device)
instead, and `index_select` takes the positions as they come (int32 or int64): two launches. A
cast commutes with a gather, so the rows are the same bits.
"""
from __future__ import annotations

import torch
from torch import nn


class RopeTables(nn.Module):
    """Holds `cos` / `sin` ([positions, dim], fp32 buffers, not saved) and gathers their rows."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # (dtype, device) -> the tables cast; built at a step's first lookup, which is eager (CUDA
        # graphs warm up before they capture), and rebuilt after the buffers move
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for this step's tokens (positions [tokens]), [tokens, 1, dim] in `dtype`; once per
        step, not per layer."""
        cos, sin = self._tables(dtype)
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def _tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        key = (dtype, self.cos.device)
        tables = self._cast.get(key)
        if tables is None:
            tables = self._cast[key] = (self.cos.to(dtype), self.sin.to(dtype))
        return tables
