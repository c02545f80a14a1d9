"""What rank 0 broadcasts to the other tensor-parallel ranks each step, as int64 tensors only
(collectives move tensors; no pickle crosses the ranks).

Every message is a fixed header, then (when the header says so) one flat payload:

    header  [HEADER_LEN] int64: op, step kind, page_size, T, B, max_pages, R, num_decode
    STEP      payload = input_ids[T] | positions[T] | slots[T] | starts[B] | num_new[B]
                        | q_starts[B] | page_table[B * max_pages] | sample_rows[R] | sample_seqs[R]
    SAMPLED   payload = the step's sampled ids [R] (published into each rank's FutureTokens, in
                        the order rank 0 published them, so placeholders resolve alike)
    SHUTDOWN  no payload: the worker returns

Input ids go over as they are (placeholders included): each rank resolves them on its own
device from its own FutureTokens, which the SAMPLED messages keep equal to rank 0's.
"""
from __future__ import annotations

import enum

import numpy as np
import torch

from ketch.forward_batch import ForwardBatch, SeqChunk, StepKind

HEADER_LEN = 8
_KINDS = (StepKind.DECODE, StepKind.EXTEND)  # index on the wire


class Op(enum.IntEnum):
    STEP = 1
    SAMPLED = 2
    SHUTDOWN = 3


def step_header(batch: ForwardBatch) -> np.ndarray:
    b, pages = batch.page_table.shape
    return np.array([Op.STEP, _KINDS.index(batch.kind), batch.page_size, batch.num_tokens, b, pages,
                     batch.sample_rows.shape[0], batch.num_decode], np.int64)


def control_header(op: Op, count: int = 0) -> np.ndarray:
    """SAMPLED (count = ids in its payload) or SHUTDOWN."""
    header = np.zeros(HEADER_LEN, np.int64)
    header[0], header[6] = op, count
    return header


def step_payload(batch: ForwardBatch) -> np.ndarray:
    parts = (batch.input_ids, batch.positions, batch.slots, batch.starts, batch.num_new, batch.q_starts,
             batch.page_table.reshape(-1), batch.sample_rows, batch.sample_seqs)
    return np.concatenate([np.asarray(p, np.int64) for p in parts])


def payload_len(header: np.ndarray) -> int:
    """How many int64s follow `header`."""
    op, _, _, t, b, pages, r, _ = (int(x) for x in header)
    if op == Op.STEP:
        return 3 * t + 3 * b + b * pages + 2 * r
    if op == Op.SAMPLED:
        return r
    if op == Op.SHUTDOWN:
        return 0
    raise ValueError(f"tensor-parallel message: unknown op {op} in header {header.tolist()}")


def decode_step(header: np.ndarray, payload: np.ndarray) -> ForwardBatch:
    """The ForwardBatch rank 0 sent: the same arrays (and SeqChunks rebuilt from them)."""
    _, kind, page_size, t, b, pages, r, num_decode = (int(x) for x in header)
    if payload.shape != (payload_len(header),):
        raise ValueError(f"tensor-parallel STEP payload: {payload.shape[0]} ints, header says {payload_len(header)}")
    sizes = (t, t, t, b, b, b, b * pages, r, r)
    ids, positions, slots, starts, news, q_starts, table, rows, seqs = np.split(payload, np.cumsum(sizes)[:-1])
    table = table.reshape(b, pages)
    used = -(-(starts + news) // page_size)  # each row's pages; the rest of the row is padding
    chunks = tuple(SeqChunk(int(s), int(n), table[i, : used[i]]) for i, (s, n) in enumerate(zip(starts, news)))
    return ForwardBatch(_KINDS[kind], page_size, chunks, num_decode, ids, positions, slots, starts, news, q_starts,
                        table, rows, seqs)


def to_wire(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """An int64 tensor on the device the collectives run on (CPU for gloo, the rank's GPU for nccl)."""
    return torch.from_numpy(np.ascontiguousarray(x, np.int64)).to(device)
