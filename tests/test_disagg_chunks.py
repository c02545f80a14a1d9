"""KV layouts and wire chunks of the tcp backend (ketch/disagg/layout.py, chunks.py): the cut
covers every (layer, page) once, a chunk round-trips byte for byte, and the receiver refuses a
chunk of another layout, a wrong size or a changed byte before it writes anything."""
from __future__ import annotations

import pytest
import torch

from disagg_peer import make_layers
from ketch.disagg.chunks import ChunkRefused, Span, check_chunk, checksum, plan_chunks, read_span, write_span
from ketch.disagg.layout import layout_of
from ketch.disagg.wire import Chunk


def chunk_of(layers, span: Span, src: torch.Tensor, seq: int = 0):
    frames = read_span(layers, span, src)
    header = Chunk(1, seq, span.layer_start, span.layer_end, span.page_start, span.page_count, checksum(frames),
                   layout_of(layers).digest)
    return header, frames


@pytest.mark.parametrize("num_layers, num_pages, chunk_bytes, cuts", [
    (2, 6, 1024, []), (3, 5, 1 << 20, []), (4, 3, 1536, []), (2, 7, 100, []), (5, 1, 512, []),
    (2, 6, 1024, [2, 5]), (3, 5, 1 << 20, [1]), (2, 7, 100, [3, 4])])  # cuts: planned in parts (send_part)
def test_the_plan_covers_every_layer_and_page_once_within_the_chunk_size(num_layers, num_pages, chunk_bytes, cuts):
    layout = layout_of(make_layers(0, 8, num_layers=num_layers))  # 512 bytes per page and layer
    bounds = [0, *cuts, num_pages]
    plan = [span for lo, hi in zip(bounds, bounds[1:]) for span in plan_chunks(layout, lo, hi, chunk_bytes)]
    cells = [(layer, page) for s in plan for layer in range(s.layer_start, s.layer_end)
             for page in range(s.page_start, s.page_start + s.page_count)]
    assert sorted(cells) == [(layer, page) for layer in range(num_layers) for page in range(num_pages)]
    assert len(cells) == len(set(cells))
    for s in plan:  # within the size, unless one page row of one layer is already larger
        size = (s.layer_end - s.layer_start) * s.page_count * layout.page_bytes_per_layer
        assert size <= max(chunk_bytes, layout.page_bytes_per_layer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_chunk_round_trips_byte_for_byte_in_any_dtype(dtype):
    src_layers = make_layers(1, 8, dtype=dtype)
    dst_layers = make_layers(2, 8, dtype=dtype)
    before = [{k: t.clone() for k, t in layer.items()} for layer in dst_layers]
    src, dst = torch.tensor([6, 1, 3]), torch.tensor([0, 7, 2])
    span = Span(0, 2, 1, 2)  # both layers, the transfer's pages 1 and 2
    header, frames = chunk_of(src_layers, span, src)
    assert check_chunk(header, frames, layout_of(dst_layers), 3) == span
    write_span(dst_layers, span, dst, frames)
    for layer in range(2):
        for name in ("k", "v"):
            got, want = dst_layers[layer][name].view(torch.uint8), src_layers[layer][name].view(torch.uint8)
            assert torch.equal(got[[7, 2]], want[[1, 3]])
            rest = [p for p in range(8) if p not in (7, 2)]
            assert torch.equal(got[rest], before[layer][name].view(torch.uint8)[rest])


@pytest.mark.parametrize("other, field", [
    (dict(page_size=8), "page_size"), (dict(num_layers=3), "num_layers"), (dict(heads=4), "tensors"),
    (dict(dtype=torch.bfloat16), "tensors"),
])
def test_a_chunk_of_another_layout_is_refused(other, field):
    sender = make_layers(1, 8)
    header, frames = chunk_of(sender, Span(0, 1, 0, 2), torch.tensor([0, 1]))
    receiver = layout_of(make_layers(2, 8, **other))
    with pytest.raises(ChunkRefused, match=f"^layout mismatch: chunk 0 has layout {layout_of(sender).digest}"):
        check_chunk(header, frames, receiver, 2)
    assert layout_of(sender).difference(receiver).startswith(f"layout mismatch: {field} is ")


def test_layouts_name_the_model_too():
    layers = make_layers(1, 4)
    assert layout_of(layers, "model-a").difference(layout_of(layers, "model-b"), "at A", "at B") == \
        "layout mismatch: model is 'model-a' at A, 'model-b' at B"
    assert layout_of(layers, "m").difference(layout_of(make_layers(9, 4), "m")) is None  # values are not layout


def test_a_changed_byte_a_short_frame_and_a_span_outside_the_pages_are_refused():
    layers = make_layers(1, 8)
    layout = layout_of(layers)
    header, frames = chunk_of(layers, Span(1, 2, 0, 2), torch.tensor([4, 5]), seq=3)
    damaged = bytearray(frames[1])
    damaged[7] ^= 1
    with pytest.raises(ChunkRefused, match="^checksum mismatch in chunk 3"):
        check_chunk(header, [frames[0], damaged], layout, 2)
    with pytest.raises(ChunkRefused, match=r"^chunk 3: frame sizes \[512, 511\], the layout needs \[512, 512\]"):
        check_chunk(header, [frames[0], damaged[:-1]], layout, 2)
    with pytest.raises(ChunkRefused, match="^chunk 3: span .* outside 2 layers x 1 pages"):
        check_chunk(header, frames, layout, 1)


def test_layout_of_refuses_layers_that_disagree():
    layers = make_layers(1, 4)
    layers[1]["v"] = layers[1]["v"].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"layers\[1\]\['v'\]"):
        layout_of(layers)
    with pytest.raises(ValueError, match="layers: one or more"):
        layout_of([])
