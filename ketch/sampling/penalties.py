"""Repetition, frequency and presence penalties over the whole batch.

Conventions (the ones clients expect):
  repetition (HF/vLLM): over prompt + output tokens; a seen token's logit l becomes
      l / r if l > 0 else l * r                      (r > 1 discourages, r < 1 encourages)
  frequency, presence (OpenAI): over output tokens only, with c = count in the output,
      l - frequency * c - presence * (c > 0)

Token counts come from ONE scatter_add into a [2, B, V] buffer: plane 0 counts output
tokens, plane 1 prompt tokens (only for rows with a repetition penalty). Rows without
penalties add no ids and carry neutral values (r = 1, f = p = 0), which leave their logits
bit-exact, so the stage runs batched without per-row branches.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ketch.host_copy import to_device

if TYPE_CHECKING:
    from ketch.sampling.batch import SamplingRow


@dataclass
class Penalties:
    size: int
    vocab_size: int
    flat_index: torch.Tensor  # [N] positions into the flattened [2, B, V] count buffer
    repetition: torch.Tensor | None  # [B, 1]; None when no row has one
    frequency: torch.Tensor | None  # [B, 1]; None (with presence) when no row has either
    presence: torch.Tensor | None  # [B, 1]

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> Penalties | None:
        """None when no row is penalized, so the caller skips the stage entirely."""
        size = len(rows)
        rep: list[float] = []
        freq: list[float] = []
        pres: list[float] = []
        segments: list[np.ndarray] = []  # token ids, one array per (plane, row)
        bases: list[int] = []  # per segment: offset of (plane, row) in the flat buffer
        any_rep = any_fp = False
        for i, row in enumerate(rows):
            p = row.params
            rep.append(p.repetition_penalty)
            freq.append(p.frequency_penalty)
            pres.append(p.presence_penalty)
            wants_rep = p.repetition_penalty != 1.0
            wants_fp = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            if not (wants_rep or wants_fp):
                continue
            any_rep |= wants_rep
            any_fp |= wants_fp
            segments.append(np.asarray(row.output_ids, dtype=np.int64))
            bases.append(i * vocab_size)
            if wants_rep:
                segments.append(np.asarray(row.prompt_ids, dtype=np.int64))
                bases.append((size + i) * vocab_size)
        if not (any_rep or any_fp):
            return None

        # Offsets are added on the host: numpy does it at memcpy speed, and the device then
        # gets one copy. (torch.tensor on a long Python list costs ~10x np.asarray.)
        lengths = [len(seg) for seg in segments]
        flat = np.concatenate(segments) + np.repeat(np.asarray(bases, dtype=np.int64), lengths)
        flat_index = to_device(flat, device)

        values = to_device([rep, freq, pres], device, torch.float32).unsqueeze(-1)
        return cls(
            size=size,
            vocab_size=vocab_size,
            flat_index=flat_index,
            repetition=values[0] if any_rep else None,
            frequency=values[1] if any_fp else None,
            presence=values[2] if any_fp else None,
        )

    def counts(self) -> torch.Tensor:
        """[2, B, V] float32: plane 0 output-token counts, plane 1 prompt-token counts."""
        buf = torch.zeros(2 * self.size * self.vocab_size, device=self.flat_index.device)
        ones = torch.ones(self.flat_index.numel(), device=buf.device)
        buf.scatter_add_(0, self.flat_index, ones)
        return buf.view(2, self.size, self.vocab_size)

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalize logits [B, V] in place and return them."""
        counts = self.counts()
        out_counts = counts[0]
        if self.repetition is not None:
            seen = (out_counts + counts[1]) > 0
            r = self.repetition
            # saturated, not inf: a penalty near 0 (below ~1e-37 it rounds to 0 in float32) makes
            # l / r overflow, and an inf logit turns the softmax into NaN; the seen tokens tie instead
            penalized = torch.where(logits > 0, logits / r, logits * r).clamp_(max=torch.finfo(logits.dtype).max)
            logits.copy_(torch.where(seen, penalized, logits))
        if self.frequency is not None:
            assert self.presence is not None
            logits.sub_(self.frequency * out_counts + self.presence * (out_counts > 0))
        return logits
