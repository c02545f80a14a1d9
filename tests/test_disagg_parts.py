"""Pipelined transfers (issue 17, "in pipelined chunks as prefill chunks finish"): rows handed
over with `send_part` while the prompt still runs move before `send`, on every backend that moves
bytes (tcp; nixl and mooncake where installed). A part whose device work is not over (its `done`
says False) is not read until it is; `send` reads only the rows no part gave (after a preemption
the prompt may sit in other pages); an abort between parts fails both sides.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from disagg_peer import make_layers, wait_until
from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport

os.environ.setdefault("UCX_TLS", "tcp")  # before any NIXL agent starts UCX

POOL = 16
SRC = [5, 6, 0, 11, 3, 7]
DST = [9, 1, 14, 4, 12, 2]
TIMEOUT_S = 30.0


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not _installed("nixl"), reason="the nixl package is not installed")),
    pytest.param("mooncake", marks=pytest.mark.skipif(not _installed("mooncake.engine"),
                                                      reason="the Mooncake transfer engine is not installed")),
]


@pytest.fixture(params=BACKENDS)
def pair(request):
    # tcp: 1,024-byte chunks (two page rows of a layer), so a part is several chunks
    # heartbeats flow, but silence counts only after 60 s (past every wait here): a pause of the test
    # process is no dead peer, and a side waiting on its peer's word cannot end by silence instead
    config = dict(transfer_backend=request.param, bootstrap_port=0, chunk_bytes=1024, window_chunks=2,
                  heartbeat_interval_s=0.3, heartbeat_misses=200, bootstrap_timeout_s=TIMEOUT_S,
                  waiting_timeout_s=TIMEOUT_S, transfer_timeout_s=TIMEOUT_S)
    src_layers, dst_layers = make_layers(1, POOL), make_layers(2, POOL)
    prefill = make_transport(DisaggConfig("prefill", **config), src_layers)
    decode = make_transport(DisaggConfig("decode", **config), dst_layers)
    yield prefill, decode, src_layers, dst_layers
    prefill.close()
    decode.close()


def open_room(prefill, decode, room: int):
    receiver = decode.receiver(room, prefill.bootstrap_addr)
    receiver.init()
    receiver.post_buffers(DST)
    sender = prefill.sender(room)
    sender.init(len(SRC))
    return sender, receiver


def rows(layers, pages: list[int]) -> list[torch.Tensor]:
    return [t[pages].view(torch.uint8).clone() for layer in layers for t in layer.values()]


def arrived(src_layers, dst_layers, lo: int, hi: int) -> bool:
    """Rows lo..hi of the transfer are in the decode pages, every tensor of every layer."""
    return all(torch.equal(a, b) for a, b in zip(rows(dst_layers, DST[lo:hi]), rows(src_layers, SRC[lo:hi])))


def ended(side) -> bool:
    return side.poll() in (KVPoll.Success, KVPoll.Failed)


def test_parts_move_before_send_and_send_ends_the_transfer(pair):
    prefill, decode, src_layers, dst_layers = pair
    sender, receiver = open_room(prefill, decode, 0x51)
    sender.send_part(SRC[:2])
    wait_until(lambda: arrived(src_layers, dst_layers, 0, 2), TIMEOUT_S, "the first part's rows at the decode side")
    sender.send_part(SRC[2:5])
    wait_until(lambda: arrived(src_layers, dst_layers, 0, 5), TIMEOUT_S, "the second part's rows")
    assert receiver.poll() == KVPoll.Transferring and sender.poll() == KVPoll.Transferring  # no Aux yet: not over
    assert not arrived(src_layers, dst_layers, 5, 6)
    # after a preemption the first rows sit in other pages now: `send` must not read them again
    moved_since = [15, 13, 10, 8, 4, SRC[5]]
    sender.send(moved_since, Aux(7, b"state"))
    wait_until(lambda: ended(receiver) and ended(sender), TIMEOUT_S, "both sides to end")
    assert (receiver.poll(), sender.poll()) == (KVPoll.Success, KVPoll.Success), (receiver.failure, sender.failure)
    assert receiver.aux == Aux(7, b"state")
    assert arrived(src_layers, dst_layers, 0, 6)


def test_a_part_is_not_read_before_its_device_work_is_done(pair):
    prefill, decode, src_layers, dst_layers = pair
    sender, receiver = open_room(prefill, decode, 0x52)
    written = threading.Event()
    asked = []

    def done() -> bool:
        asked.append(1)
        return written.is_set()

    before = rows(dst_layers, DST[:3])
    sender.send_part(SRC[:3], done)
    wait_until(lambda: len(asked) >= 3, TIMEOUT_S, "the transport to ask whether the part is written")
    assert all(torch.equal(a, b) for a, b in zip(rows(dst_layers, DST[:3]), before))  # nothing moved
    for layer in src_layers:  # what the device writes last: the rows that must arrive
        for t in layer.values():
            t[SRC[:3]] += 1.0
    written.set()
    wait_until(lambda: arrived(src_layers, dst_layers, 0, 3), TIMEOUT_S, "the part's rows once written")
    sender.send(SRC, Aux(1))
    wait_until(lambda: ended(receiver) and ended(sender), TIMEOUT_S, "both sides to end")
    assert (receiver.poll(), sender.poll()) == (KVPoll.Success, KVPoll.Success), (receiver.failure, sender.failure)
    assert arrived(src_layers, dst_layers, 0, 6)


def test_parts_may_cover_every_row_and_send_only_adds_the_aux(pair):
    """The parts reach the last row before send() is called (the rows before it arrive first):
    on a peer-read data plane the last row waits for the Aux (a Ready that reached the last page
    without it was refused by the decode side: a race that failed whenever the parts went out first)."""
    prefill, decode, src_layers, dst_layers = pair
    sender, receiver = open_room(prefill, decode, 0x53)
    sender.send_part(SRC[:4])
    sender.send_part(SRC[4:])
    wait_until(lambda: arrived(src_layers, dst_layers, 0, 5) or ended(receiver), TIMEOUT_S, "the rows before the last")
    assert not ended(receiver), receiver.failure
    sender.send(SRC, Aux(3))
    wait_until(lambda: ended(receiver) and ended(sender), TIMEOUT_S, "both sides to end")
    assert (receiver.poll(), sender.poll()) == (KVPoll.Success, KVPoll.Success), (receiver.failure, sender.failure)
    assert arrived(src_layers, dst_layers, 0, 6)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_between_parts_fails_both_sides(pair, side):
    prefill, decode, src_layers, dst_layers = pair
    sender, receiver = open_room(prefill, decode, 0x54)
    sender.send_part(SRC[:2])
    wait_until(lambda: arrived(src_layers, dst_layers, 0, 2), TIMEOUT_S, "the first part's rows")
    (sender if side == "prefill" else receiver).abort("client gone")
    wait_until(lambda: ended(receiver) and ended(sender), TIMEOUT_S, "both sides to fail")
    assert (receiver.poll(), sender.poll()) == (KVPoll.Failed, KVPoll.Failed)
    assert "client gone" in receiver.failure and "client gone" in sender.failure


def test_parts_are_checked_on_the_engine_thread(pair):
    prefill, decode, _, _ = pair
    sender, _ = open_room(prefill, decode, 0x55)
    with pytest.raises(ValueError, match="src_pages"):
        sender.send_part(SRC + [1])  # more rows than init said
    with pytest.raises(ValueError, match="src_pages"):
        sender.send_part([POOL])  # not a page of the pool
    sender.send(SRC, Aux(0))
    with pytest.raises(RuntimeError, match="send_part after send"):
        sender.send_part(SRC[:1])
