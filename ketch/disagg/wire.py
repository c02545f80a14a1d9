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

The nixl backend keeps this control plane and moves the bytes itself: Welcome carries the
prefill's NIXL agent (metadata, where each tensor starts); `send` becomes Ready(room, src_pages,
aux) (and each `send_part` before it a Ready of those rows without the Aux); the decode side READs
the rows, one Ready after the other, and answers Received after the last. A decode side that stops a READ it
had started (an abort from either side) says Released once the READ can no longer touch the
prefill's pages: only then may the prefill side free them. The mooncake backend is the same
dance with a Mooncake transfer engine: Welcome carries its session ("host:rpc port") and bases.
"""
from __future__ import annotations

import msgspec

from ketch.disagg.layout import KVLayout
from ketch.disagg.transport import Aux


class Hello(msgspec.Struct, tag=True, frozen=True):
    room: int
    layout: KVLayout
    backend: str  # "tcp" | "nixl" | "mooncake": a decode side of another backend is refused by name


class Post(msgspec.Struct, tag=True, frozen=True):
    room: int
    dst_pages: list[int]


class NixlPeer(msgspec.Struct, frozen=True):
    """A prefill side's NIXL agent, as a decode side needs it to READ from it."""

    agent: str  # its name, unique per process
    metadata: bytes  # nixl_agent.get_agent_metadata(): how to reach it and its registered memory
    bases: list[int]  # the address of each (layer, tensor) in layout order; page p's row at base + p * row bytes
    mem_type: str  # "DRAM" (a CPU pool) or "VRAM"
    device_id: int


class MooncakePeer(msgspec.Struct, frozen=True):
    """A prefill side's Mooncake transfer engine, as a decode side needs it to READ from it."""

    session: str  # "host:rpc port": the engine's P2P handshake address, the segment name to READ from
    bases: list[int]  # the address of each (layer, tensor) in layout order, as NixlPeer.bases


class Welcome(msgspec.Struct, tag=True, frozen=True):
    room: int
    nixl: NixlPeer | None = None
    mooncake: MooncakePeer | None = None


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


class Ready(msgspec.Struct, tag=True, frozen=True):
    """nixl, mooncake: rows page_start.. of the transfer are in src_pages; read them. A room's
    Readys come in order, each starting where the one before ended; the last carries the Aux
    (earlier ones: parts sent while the prompt still ran) and may name no page."""

    room: int
    src_pages: list[int]
    aux: Aux | None  # None: more rows follow
    page_start: int = 0  # into the transfer's page lists


class Received(msgspec.Struct, tag=True, frozen=True):
    room: int


class Released(msgspec.Struct, tag=True, frozen=True):
    """nixl, mooncake: the decode side's READ of this room is over (cancelled or finished) after an abort."""

    room: int


class Abort(msgspec.Struct, tag=True, frozen=True):
    room: int
    reason: str  # what the receiving side records as its failure, verbatim ("peer aborted: ...")


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    pass


ToPrefill = Hello | Post | Credit | Received | Released | Abort | Heartbeat
ToDecode = Welcome | Chunk | Done | Ready | Abort | Heartbeat

# the module functions, not shared Encoder/Decoder objects: two transports of one process (a test,
# or prefill and decode beside each other) run their threads at once
encode = msgspec.msgpack.encode


def decode_to_prefill(data: bytes) -> ToPrefill:
    return msgspec.msgpack.decode(data, type=ToPrefill)


def decode_to_decode(data: bytes) -> ToDecode:
    return msgspec.msgpack.decode(data, type=ToDecode)
