"""Counters of speculative decoding, for /metrics and `ketch bench`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_draft_tokens: int  # k: the longest draft a step verifies
    proposed_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of which the target kept
    verifies: int = 0  # sequences verified with at least one draft token
    # accept_counts[a]: verifies that kept a draft tokens (0..k); the acceptance length of a
    # verify is a + 1 (the target's own token comes on top)
    accept_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accept_counts = [0] * (self.num_draft_tokens + 1)

    def count(self, proposed: int, accepted: int) -> None:
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verifies += 1
        self.accept_counts[accepted] += 1

    @property
    def mean_accept_length(self) -> float:
        """Tokens per verified sequence and step: accepted drafts + the target's own."""
        return 1.0 + self.accepted_tokens / self.verifies if self.verifies else 0.0
