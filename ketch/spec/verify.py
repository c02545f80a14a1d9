"""The host's side of a verify: which of a sequence's k + 1 sampled rows become output.

Row j of a verified sequence sampled the token that follows the last token and drafts d_0..d_j-1
(sampling/sampler.py) as a plain row at its output index: the argmax for greedy rows, the draw of
that index's number for sampled ones (so d_j is kept with probability p(d_j)). Row j's token is
the target's own whenever d_0..d_j-1 were, so the output is the rows up to and including the
first disagreement (or all k + 1: every draft kept, plus the target's token after the last).
"""
from __future__ import annotations

from collections.abc import Sequence


def accepted_rows(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of the len(draft) + 1 sampled rows are output: 1 + the drafts kept."""
    for j, d in enumerate(draft):
        if sampled[j] != d:
            return j + 1
    return len(draft) + 1
