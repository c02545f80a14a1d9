"""The proposer contract: given each sequence's tokens so far, guess its next few tokens.

    engine, each step:  drafts = proposer.propose([DraftInput(ids, max_draft), ...])
    verify (sampling):  the target runs the last token + the drafts in one forward and keeps the
                        longest prefix its own tokens (argmax, or the seeded draw at each
                        position) agree with, plus one token of its own

A proposer only guesses: it may return fewer tokens than asked, or none, and what it returns never
changes any output (only how many tokens a step yields). Verify and KV rollback live in the engine
and the sampler, not here. Every draft so far is a point guess (all its mass on one token), which
the verify's accept rule assumes (kept with probability p(d)); a proposer that samples its drafts
would need a residual draw instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class DraftInput:
    """One sequence to propose for: every token id it has (prompt + output, all known) and the
    most draft tokens the step may verify for it (its remaining length and the step's budget)."""

    token_ids: np.ndarray  # int64 [L]
    max_draft: int
    # the target's final hidden state at the row that produced the last token (what `block`
    # drafts from; None before the request's first sampled row)
    hidden: torch.Tensor | None = None


class Proposer(Protocol):
    name: str  # the --speculative-algorithm value: labels its metrics

    def propose(self, batch: Sequence[DraftInput]) -> list[list[int]]:
        """Draft ids per sequence, each at most its max_draft long (possibly empty)."""
        ...

    def check_invariants(self) -> None:
        """Between steps: whatever the proposer holds is consistent (the draft model: every page of
        its pool free or cached, none held). AssertionError otherwise."""
        ...
