"""Prompt lookup: draft what followed the last time this sequence's recent tokens appeared.

No model: the longest suffix of the sequence (at most max_n tokens, at least min_n) that also
occurs earlier in its own prompt + output is found, and the tokens that followed its most recent
earlier occurrence are the draft. Pays where the output copies its input: code edits, quoting,
summaries that reuse phrases, JSON that repeats keys.

The search walks back from the last token: the candidates are the earlier positions holding the
same token; each round keeps those whose preceding token also matches, until none is left or the
match is max_n long. Numpy over the whole history, one pass per matched token: ~20 µs for a few
thousand tokens, so it need not be incremental.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ketch.spec.proposer import DraftInput


class NgramProposer:
    name = "ngram"

    def __init__(self, num_draft_tokens: int, min_n: int = 1, max_n: int = 12) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram window: need 1 <= min ({min_n}) <= max ({max_n})")
        self.k, self.min_n, self.max_n = num_draft_tokens, min_n, max_n

    def propose(self, batch: Sequence[DraftInput]) -> list[list[int]]:
        return [self.lookup(x.token_ids, min(self.k, x.max_draft)) for x in batch]

    def lookup(self, ids: np.ndarray, k: int) -> list[int]:
        """The k tokens after the most recent earlier occurrence of the longest matching suffix."""
        last = ids.shape[0] - 1
        if k <= 0 or last < 1:
            return []
        ends = np.flatnonzero(ids[:last] == ids[last])  # earlier occurrences of the last token
        length = 1
        while ends.size and length < self.max_n:
            starts = ends - length  # the token before each match so far ...
            ok = starts >= 0
            longer = ends[ok][ids[starts[ok]] == ids[last - length]]  # ... matches the suffix's too
            if not longer.size:
                break
            ends, length = longer, length + 1
        if not ends.size or length < self.min_n:
            return []
        j = int(ends[-1]) + 1  # the most recent match: the copy most likely to continue
        return ids[j : j + k].tolist()

    def check_invariants(self) -> None:
        pass  # holds nothing between steps
