"""The tensor-parallel wire (engine/batch_wire.py): a ForwardBatch goes over as one int64 header
and one flat int64 payload and comes back with every array equal (placeholders included), and
the kind, page size and decode count kept; control messages carry their count."""
from __future__ import annotations

import numpy as np
import pytest

from ketch.engine import batch_wire as wire
from ketch.forward_batch import ForwardBatch, SeqChunk, StepKind

ARRAYS = ("input_ids", "positions", "slots", "starts", "num_new", "q_starts", "page_table", "sample_rows",
          "sample_seqs")


def round_trip(batch: ForwardBatch) -> ForwardBatch:
    header, payload = wire.step_header(batch), wire.step_payload(batch)
    assert header.dtype == payload.dtype == np.int64 and header.shape == (wire.HEADER_LEN,)
    assert payload.shape == (wire.payload_len(header),)
    return wire.decode_step(header, payload)


def assert_same(a: ForwardBatch, b: ForwardBatch) -> None:
    assert (a.kind, a.page_size, a.num_decode, a.num_seqs) == (b.kind, b.page_size, b.num_decode, b.num_seqs)
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for s, t in zip(a.seqs, b.seqs, strict=True):
        assert (s.start, s.num_new) == (t.start, t.num_new)
        assert list(t.page_table) == list(s.page_table[: len(t.page_table)])


def test_extend_batch_with_placeholders_and_verify_rows():
    seqs = [SeqChunk(5, 1, [3, 9]), SeqChunk(0, 6, [4, 7]), SeqChunk(8, 3, [1, 2, 6])]
    ids = [-3, 11, 12, 13, 14, 15, 16, -1, 20, 21]  # decode row and a chunk behind it: placeholders
    batch = ForwardBatch.build(seqs, 4, ids, sample_rows=[0, 6, 7, 8, 9], sample_seqs=[0, 1, 2, 2, 2])
    assert batch.kind is StepKind.EXTEND
    assert_same(batch, round_trip(batch))


def test_decode_batch():
    batch = ForwardBatch.build([SeqChunk(n, 1, [p, p + 1]) for n, p in ((3, 0), (6, 2), (4, 8))], 4, [-1, -2, 7])
    assert batch.kind is StepKind.DECODE
    assert_same(batch, round_trip(batch))


def test_control_messages_and_a_short_payload():
    sampled = wire.control_header(wire.Op.SAMPLED, 3)
    assert wire.payload_len(sampled) == 3 and wire.payload_len(wire.control_header(wire.Op.SHUTDOWN)) == 0
    batch = ForwardBatch.build([SeqChunk(0, 3, [0])], 4, [1, 2, 3])
    with pytest.raises(ValueError, match="payload"):
        wire.decode_step(wire.step_header(batch), wire.step_payload(batch)[:-1])
    with pytest.raises(ValueError, match="unknown op"):
        wire.payload_len(np.zeros(wire.HEADER_LEN, np.int64))
