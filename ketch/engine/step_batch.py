"""The scheduler's choice for a step, as the runner's `ForwardBatch` (the one place where
requests become plain data: ids, positions, pages)."""
from __future__ import annotations

from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.scheduler.scheduler import ScheduledChunk


def forward_batch(chunks: list[ScheduledChunk], page_size: int) -> ForwardBatch:
    """Each chunk runs tokens [num_computed, num_computed + num_new) of its request (the last ones
    its draft, under speculation); a chunk that reaches the end of its sequence samples its last
    token, and each draft token after it (verify rows)."""
    seqs: list[SeqChunk] = []
    ids: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        req, start = c.req, c.req.num_computed
        ids.extend(req.tokens(start, start + c.num_new - len(c.draft)))
        ids.extend(c.draft)
        seqs.append(SeqChunk(start, c.num_new, req.page_table))
        if c.samples:
            sample_rows.extend(range(len(ids) - 1 - len(c.draft), len(ids)))
    return ForwardBatch.build(seqs, page_size, ids, sample_rows)
