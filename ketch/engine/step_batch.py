"""The scheduler's choice for a step, as the runner's `ForwardBatch` (the one place where
requests become plain data: ids, positions, pages)."""
from __future__ import annotations

from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.scheduler.scheduler import ScheduledChunk


def forward_batch(chunks: list[ScheduledChunk], page_size: int) -> ForwardBatch:
    """Each chunk runs tokens [num_computed, num_computed + num_new) of its request; a chunk that
    reaches the end of its sequence samples its last token.

    A verify chunk (speculation: the last token + k draft tokens) runs as k + 1 decode rows over
    the request's one page table, row j at position start + j seeing kv_len start + j + 1: the
    step is still a DECODE step (the decode attention kernels, the decode CUDA graphs of k + 1
    times the batch size), each row computes exactly what a plain decode step at that position
    would, and every row's K/V is stored before any row's attention reads the pool."""
    seqs: list[SeqChunk] = []
    ids: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        req, start = c.req, c.req.num_computed
        if c.draft:
            ids.extend(req.tokens(start, start + 1))
            ids.extend(c.draft)
            seqs.extend(SeqChunk(start + j, 1, req.page_table) for j in range(len(c.draft) + 1))
            sample_rows.extend(range(len(ids) - 1 - len(c.draft), len(ids)))
            continue
        ids.extend(req.tokens(start, start + c.num_new))
        seqs.append(SeqChunk(start, c.num_new, req.page_table))
        if c.samples:
            sample_rows.append(len(ids) - 1)
    return ForwardBatch.build(seqs, page_size, ids, sample_rows)
