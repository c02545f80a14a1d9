"""`oracle`: proposes the target's own greedy continuation, recorded beforehand — for benchmarks
only (no flag selects it). Every draft is accepted, so a greedy run with it measures the upper
bound of the verify machinery at k: what speculation would give if every guess were right. With
`correct=m` only the first m tokens of a draft are the continuation and the rest are wrong (the
next id, wrapping in the vocabulary): an acceptance length of m + 1 on demand, to find where the
cost model turns speculation off."""
from __future__ import annotations

from collections.abc import Sequence

from ketch.spec.proposer import DraftInput


class OracleProposer:
    name = "oracle"

    def __init__(self, num_draft_tokens: int, runs: dict[tuple[int, ...], list[int]], correct: int | None = None,
                 vocab_size: int = 0) -> None:
        """runs: prompt ids -> the target's greedy output for it (a run without speculation)."""
        if correct is not None and not (0 <= correct <= num_draft_tokens and vocab_size > 1):
            raise ValueError(f"correct: {correct} must lie in 0..{num_draft_tokens}, with the vocab_size given")
        self.k = num_draft_tokens
        self._runs = runs
        self._correct = correct
        self._vocab = vocab_size
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
                    if self._correct is not None:
                        draft = draft[:self._correct] + [(t + 1) % self._vocab for t in draft[self._correct:]]
                    break
            out.append(draft)
        return out

    def check_invariants(self) -> None:
        pass
