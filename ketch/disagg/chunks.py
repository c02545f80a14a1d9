"""Page rows as wire chunks (tcp backend): how a transfer is cut, read out and written back.

A transfer moves rows src_pages[i] of every tensor of every layer into rows dst_pages[i] of the
receiver's tensors. It is cut into spans of (layers, pages) of about `chunk_bytes` each: whole
layers while a layer's rows fit (few chunks for short prompts), else page ranges of one layer.
A chunk's payload is one frame per (layer, tensor) of its span, the rows as raw bytes (dtype-blind:
fp8 pages move as they are); its crc32 covers the frames in order. The receiver checks the
header and the checksum before it writes any row, then writes with index_copy_ on the page dim.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ketch.disagg.layout import KVLayout
from ketch.disagg.wire import Chunk


class ChunkRefused(Exception):
    """A chunk that must not be written: its message is the room's failure reason."""


@dataclass(frozen=True)
class Span:
    layer_start: int
    layer_end: int  # exclusive
    page_start: int
    page_count: int


def plan_chunks(layout: KVLayout, page_start: int, page_end: int, chunk_bytes: int) -> list[Span]:
    """Spans covering every (layer, page) of pages [page_start, page_end) of the transfer once,
    in layer order, each at most `chunk_bytes` of payload unless a single page row of one layer
    is larger. A transfer sent in parts is planned part by part."""
    num_pages = page_end - page_start
    per_page = layout.page_bytes_per_layer
    if per_page * num_pages <= chunk_bytes:
        layers = max(1, chunk_bytes // (per_page * num_pages))
        return [Span(l0, min(l0 + layers, layout.num_layers), page_start, num_pages)
                for l0 in range(0, layout.num_layers, layers)]
    pages = max(1, chunk_bytes // per_page)
    return [Span(layer, layer + 1, p0, min(pages, page_end - p0))
            for layer in range(layout.num_layers) for p0 in range(page_start, page_end, pages)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8 (the last dim times the item size): rows copy without a dtype."""
    return t.view(torch.uint8)


def read_span(layers: list[dict[str, torch.Tensor]], span: Span, src: torch.Tensor) -> list[memoryview]:
    """The frames of `span`: rows src[page_start:page_start+page_count] of each tensor of each
    layer, on the host. src: the transfer's source page ids (an int64 tensor on the pool's device)."""
    rows = src[span.page_start:span.page_start + span.page_count]
    frames = []
    for layer in layers[span.layer_start:span.layer_end]:
        for t in layer.values():
            picked = _as_bytes(t).index_select(0, rows).cpu()  # a fresh contiguous copy
            frames.append(memoryview(picked.numpy()).cast("B"))
    return frames


def checksum(frames: list) -> int:
    crc = 0
    for frame in frames:
        crc = zlib.crc32(frame, crc)
    return crc


def check_chunk(header: Chunk, frames: list, layout: KVLayout, num_pages: int) -> Span:
    """The span a received chunk writes; ChunkRefused (with the reason) for a chunk of another
    layout, one that does not fit the posted pages, or one whose bytes changed on the way."""
    if header.layout != layout.digest:
        raise ChunkRefused(f"layout mismatch: chunk {header.seq} has layout {header.layout}, "
                           f"the receiver's is {layout.digest}")
    span = Span(header.layer_start, header.layer_end, header.page_start, header.page_count)
    if not (0 <= span.layer_start < span.layer_end <= layout.num_layers and span.page_count >= 1
            and 0 <= span.page_start and span.page_start + span.page_count <= num_pages):
        raise ChunkRefused(f"chunk {header.seq}: span {span} outside {layout.num_layers} layers x {num_pages} pages")
    expected = [span.page_count * layout.page_size * t.page_bytes_per_token
                for _ in range(span.layer_start, span.layer_end) for t in layout.tensors]
    sizes = [len(f) for f in frames]
    if sizes != expected:
        raise ChunkRefused(f"chunk {header.seq}: frame sizes {sizes}, the layout needs {expected}")
    crc = checksum(frames)
    if crc != header.crc32:
        raise ChunkRefused(f"checksum mismatch in chunk {header.seq}: crc32 {crc:#010x}, header says {header.crc32:#010x}")
    return span


def write_span(layers: list[dict[str, torch.Tensor]], span: Span, dst: torch.Tensor, frames: list) -> None:
    """Write a checked chunk's frames into rows dst[page_start:page_start+page_count]."""
    rows = dst[span.page_start:span.page_start + span.page_count]
    it = iter(frames)
    for layer in layers[span.layer_start:span.layer_end]:
        for t in layer.values():
            target = _as_bytes(t)
            # bytearray: a writable buffer, so torch shares it instead of warning (the frame is read-only)
            data = torch.frombuffer(bytearray(next(it)), dtype=torch.uint8).view(span.page_count, *target.shape[1:])
            target.index_copy_(0, rows, data.to(target.device))
