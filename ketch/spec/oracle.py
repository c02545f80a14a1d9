"""`oracle`: proposes the target's own greedy continuation, recorded beforehand — for benchmarks
only (no flag selects it). Every draft is accepted, so a greedy run with it measures the upper
bound of the verify machinery at k: what speculation would give if every guess were right."""
from __future__ import annotations

from collections.abc import Sequence

from ketch.spec.proposer import DraftInput


class OracleProposer:
    name = "oracle"

    def __init__(self, num_draft_tokens: int, runs: dict[tuple[int, ...], list[int]]) -> None:
        """runs: prompt ids -> the target's greedy output for it (a run without speculation)."""
        self.k = num_draft_tokens
        self._runs = runs
        self._lengths = sorted({len(p) for p in runs})

    def propose(self, batch: Sequence[DraftInput]) -> list[list[int]]:
        out = []
        for x in batch:
            ids = x.token_ids.tolist()
            draft: list[int] = []
            for n in self._lengths:
                run = self._runs.get(tuple(ids[:n]))
                if run is not None:
                    done = len(ids) - n
                    draft = run[done:done + min(self.k, x.max_draft)]
                    break
            out.append(draft)
        return out

    def check_invariants(self) -> None:
        pass
