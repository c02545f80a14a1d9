"""Sampled token ids that are still on the device, named on the host by placeholders.

With overlap scheduling the host schedules step N+1 before it has seen step N's tokens. Step
N's sampler writes its ids into this buffer, and each request's output gets a negative
placeholder in the meantime; step N+1's input ids are resolved on the device (`resolve`,
inside the decode CUDA graphs too), so the ids never make a round trip through the host. The
engine replaces a placeholder with the real id when it processes step N, which is always
before it schedules step N+2; so two halves, used by alternate steps, are enough.

Without overlap the same path runs: the placeholder is resolved right after its step.

One int64 table holds both kinds of id: entries [0, 2M) are the two halves of sampled ids (M =
max_rows), entry 2M + t holds t for every vocabulary id t. A placeholder is its slot - 2M, so
every input id, placeholder or not, resolves as table[id + 2M]: one add and one gather. (A
`where` over placeholders took six launches, ~10 µs of a batch-1 decode graph on the H200.)
"""
from __future__ import annotations

import torch


def is_placeholder(token: int) -> bool:
    return token < 0


class FutureTokens:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.offset = 2 * max_rows  # table index of id 0; a placeholder is slot - offset
        self.table = torch.cat((torch.zeros(self.offset, dtype=torch.long),
                                torch.arange(vocab_size, dtype=torch.long))).to(device)
        self._half = 0

    def publish(self, token_ids: torch.Tensor) -> list[int]:
        """Store a step's sampled ids [n] (on the device); returns their placeholders."""
        n = token_ids.shape[0]
        if n > self.max_rows:
            raise ValueError(f"a step sampled {n} rows; the buffer holds {self.max_rows}")
        base = self._half * self.max_rows
        self._half ^= 1
        self.table[base : base + n].copy_(token_ids)
        return [base + i - self.offset for i in range(n)]

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` [n] (int32 or int64, on the device) with placeholders replaced: int64."""
        return self.table.index_select(0, ids + self.offset)
