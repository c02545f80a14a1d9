"""Messages of the tcp backend's one connection per (decode process, prefill bootstrap server).

The decode side's DEALER talks to the prefill side's ROUTER (the bootstrap server); both
directions carry msgspec structs (msgpack, tagged; never pickle). A data chunk is a multipart
message: its `Chunk` header, then one frame per (layer, tensor) of its span holding the page rows
as raw bytes.

    decode ──Hello(room, layout)──▶ prefill     ◀──Welcome(room) | Abort(room, reason)──
    decode ──Post(room, dst_pages)──▶
                                               ◀──Chunk(...) + frames── (window_chunks in flight)
    decode ──Credit(room, seq)──▶   (one per chunk written: the sender may send one more)
                                               ◀──Done(room, num_chunks, aux)──
    decode ──Received(room)──▶      (every byte written: the sender's Success, its pages free)
    either ──Abort(room, reason)──▶ ;  either ──Heartbeat()──▶ (every interval while rooms live)
"""
from __future__ import annotations

import msgspec

from ketch.disagg.layout import KVLayout
from ketch.disagg.transport import Aux


class Hello(msgspec.Struct, tag=True, frozen=True):
    room: int
    layout: KVLayout


class Post(msgspec.Struct, tag=True, frozen=True):
    room: int
    dst_pages: list[int]


class Welcome(msgspec.Struct, tag=True, frozen=True):
    room: int


class Chunk(msgspec.Struct, tag=True, frozen=True):
    room: int
    seq: int  # 0, 1, ... in the order sent
    layer_start: int
    layer_end: int  # exclusive
    page_start: int  # into the transfer's page lists (src and dst alike), not page ids
    page_count: int
    crc32: int  # of the frames, in order
    layout: str  # the sender's KVLayout digest


class Credit(msgspec.Struct, tag=True, frozen=True):
    room: int
    seq: int


class Done(msgspec.Struct, tag=True, frozen=True):
    room: int
    num_chunks: int
    aux: Aux


class Received(msgspec.Struct, tag=True, frozen=True):
    room: int


class Abort(msgspec.Struct, tag=True, frozen=True):
    room: int
    reason: str  # what the receiving side records as its failure, verbatim ("peer aborted: ...")


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    pass


ToPrefill = Hello | Post | Credit | Received | Abort | Heartbeat
ToDecode = Welcome | Chunk | Done | Abort | Heartbeat

# the module functions, not shared Encoder/Decoder objects: two transports of one process (a test,
# or prefill and decode beside each other) run their threads at once
encode = msgspec.msgpack.encode


def decode_to_prefill(data: bytes) -> ToPrefill:
    return msgspec.msgpack.decode(data, type=ToPrefill)


def decode_to_decode(data: bytes) -> ToDecode:
    return msgspec.msgpack.decode(data, type=ToDecode)
