"""The tcp transport's refusals, timeouts and aborts, with both sides in this process (real
sockets and threads; the two-process cases are in test_disagg_tcp.py): every wait ends, with a
reason both sides can read, and no page is written after a room failed."""
from __future__ import annotations

import socket
import threading

import pytest
import torch
import zmq

from disagg_peer import make_layers, wait_until
from ketch.disagg import Aux, DisaggConfig, KVPoll
from ketch.disagg.tcp_decode import TcpDecodeTransport
from ketch.disagg.tcp_prefill import TcpPrefillTransport

POOL = 12
# heartbeats flow, but a peer is presumed dead only after 30 s of silence: a pause of the test
# process (a garbage collection late in the suite) is no dead peer; tests about silence shorten it
FAST = dict(bootstrap_port=0, heartbeat_interval_s=0.2, heartbeat_misses=150, chunk_bytes=1024, window_chunks=2,
            bootstrap_timeout_s=10.0, waiting_timeout_s=10.0, transfer_timeout_s=10.0)


def ended(side) -> bool:
    return side.poll() in (KVPoll.Success, KVPoll.Failed)


@pytest.fixture
def pair(request):
    """A prefill and a decode transport; a test's `overrides` (indirect param) change the config
    ("prefill": {...} only the prefill side's), and "decode_layers" the decode pool."""
    opts = dict(getattr(request, "param", {}))
    decode_layers = opts.pop("decode_layers", None)
    hook = opts.pop("wire_hook", None)
    prefill_only = opts.pop("prefill", {})
    config = {**FAST, **opts}
    prefill = TcpPrefillTransport(DisaggConfig("prefill", **{**config, **prefill_only}), make_layers(1, POOL),
                                  wire_hook=hook)
    decode = TcpDecodeTransport(DisaggConfig("decode", **config), decode_layers or make_layers(2, POOL))
    yield prefill, decode
    prefill.close()
    decode.close()


def start(prefill, decode, room: int, src: list[int], dst: list[int], send: bool = True):
    receiver = decode.receiver(room, prefill.bootstrap_addr)
    receiver.init()
    receiver.post_buffers(dst)
    sender = prefill.sender(room)
    sender.init(len(src))
    if send:
        sender.send(src, Aux(room % 1000))
    return sender, receiver


def test_many_rooms_at_once_in_bfloat16_each_gets_its_own_rows():
    config = {**FAST, "chunk_bytes": 300}  # smaller than one layer's page rows: page ranges of single layers
    src_layers = make_layers(1, 64, num_layers=3, dtype=torch.bfloat16)
    dst_layers = make_layers(2, 64, num_layers=3, dtype=torch.bfloat16)
    prefill = TcpPrefillTransport(DisaggConfig("prefill", **config), src_layers)
    decode = TcpDecodeTransport(DisaggConfig("decode", **config), dst_layers)
    try:
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
        rooms = {room: (list(range(4 * i, 4 * i + 3)), perm[4 * i:4 * i + 3]) for i, room in enumerate(range(100, 108))}
        pairs = [start(prefill, decode, room, src, dst) for room, (src, dst) in rooms.items()]
        for sender, receiver in pairs:
            wait_until(lambda: ended(sender) and ended(receiver), 30, f"room {sender.room}")
            assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (sender.failure, receiver.failure)
            assert receiver.aux == Aux(sender.room % 1000)
        for src, dst in rooms.values():
            for layer in range(3):
                for name in ("k", "v"):
                    assert torch.equal(dst_layers[layer][name][dst].view(torch.uint8),
                                       src_layers[layer][name][src].view(torch.uint8))
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("pair", [{"decode_layers": make_layers(2, POOL, page_size=8)}], indirect=True)
def test_a_decode_side_of_another_layout_is_refused_on_both_sides(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 1, [0, 1], [2, 3])
    wait_until(lambda: ended(sender) and ended(receiver), 10, "the refusal")
    expected = "layout mismatch: page_size is 4 at the prefill side, 8 at the decode side"
    assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, expected)
    assert (sender.poll(), sender.failure) == (KVPoll.Failed, expected)


def test_a_bootstrap_server_that_never_answers_fails_the_receiver_at_the_timeout():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    decode = TcpDecodeTransport(DisaggConfig("decode", **{**FAST, "bootstrap_timeout_s": 0.5}), make_layers(2, POOL))
    try:
        receiver = decode.receiver(9, addr)
        receiver.init()
        receiver.post_buffers([0, 1])
        took = wait_until(lambda: ended(receiver), 5, "the bootstrap timeout")
        assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, "Bootstrapping timed out after 0.5 s")
        assert 0.5 <= took < 3
    finally:
        decode.close()


@pytest.mark.parametrize("pair", [{"bootstrap_timeout_s": 0.5}], indirect=True)
def test_a_sender_no_decode_side_registers_for_fails_at_the_bootstrap_timeout(pair):
    prefill, _ = pair
    sender = prefill.sender(3)
    sender.init(2)
    sender.send([0, 1], Aux(1))
    wait_until(lambda: ended(sender), 5, "the bootstrap timeout")
    assert (sender.poll(), sender.failure) == (KVPoll.Failed, "Bootstrapping timed out after 0.5 s")


@pytest.mark.parametrize("pair", [{"bootstrap_timeout_s": 0.5, "waiting_timeout_s": 30.0}], indirect=True)
def test_a_registration_no_prefill_request_claims_is_refused(pair):
    prefill, decode = pair
    receiver = decode.receiver(4, prefill.bootstrap_addr)
    receiver.init()
    receiver.post_buffers([0, 1])
    wait_until(lambda: receiver.poll() == KVPoll.WaitingForInput, 5, "the welcome")
    wait_until(lambda: ended(receiver), 5, "the refusal")
    assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, "no prefill request for room 4 within 0.5 s")


@pytest.mark.parametrize("pair", [{"waiting_timeout_s": 0.5}], indirect=True)
def test_a_prefill_that_never_sends_fails_both_sides_at_the_waiting_timeout(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 5, [0, 1], [2, 3], send=False)
    wait_until(lambda: ended(sender) and ended(receiver), 5, "the waiting timeout")
    assert receiver.failure in ("WaitingForInput timed out after 0.5 s", "peer failed: WaitingForInput timed out after 0.5 s")
    assert sender.failure in ("WaitingForInput timed out after 0.5 s", "peer failed: WaitingForInput timed out after 0.5 s")
    assert KVPoll.Failed == sender.poll() == receiver.poll()


def test_a_transfer_that_stops_fails_at_the_transfer_timeout_and_the_late_chunks_are_not_written():
    release = threading.Event()

    def hold_chunk_1(seq: int, frames: list) -> list:
        if seq == 1:
            release.wait(10)
        return frames

    config = {**FAST, "heartbeat_interval_s": 2.0}  # the timeout decides, not the heartbeat; the decode side's
    dst_layers = make_layers(2, POOL)
    prefill = TcpPrefillTransport(DisaggConfig("prefill", **config), make_layers(1, POOL), wire_hook=hold_chunk_1)
    decode = TcpDecodeTransport(DisaggConfig("decode", **{**config, "transfer_timeout_s": 0.5}), dst_layers)
    try:
        dst = [6, 7, 8, 9]
        sender, receiver = start(prefill, decode, 6, [0, 1, 2, 3], dst)
        wait_until(lambda: ended(receiver), 5, "the transfer timeout")
        assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, "Transferring timed out after 0.5 s")
        before = [{k: t.clone() for k, t in layer.items()} for layer in dst_layers]
        release.set()
        wait_until(lambda: ended(sender), 5, "the sender to learn")
        assert (sender.poll(), sender.failure) == (KVPoll.Failed, "peer failed: Transferring timed out after 0.5 s")
        for layer in range(2):  # chunk 1 and after reached a failed room: dropped, not written
            for name in ("k", "v"):
                assert torch.equal(dst_layers[layer][name], before[layer][name])
    finally:
        release.set()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_an_abort_on_one_side_fails_the_other(pair, side):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 7, [0, 1], [2, 3], send=False)
    wait_until(lambda: sender.poll() == receiver.poll() == KVPoll.WaitingForInput, 5, "both sides ready")
    aborting, other = (receiver, sender) if side == "decode" else (sender, receiver)
    aborting.abort("client went away")
    assert (aborting.poll(), aborting.failure) == (KVPoll.Failed, "aborted: client went away")
    wait_until(lambda: ended(other), 5, "the abort to reach the other side")
    assert (other.poll(), other.failure) == (KVPoll.Failed, "peer aborted: client went away")


def test_a_sender_aborted_before_the_decode_side_registers_refuses_it(pair):
    prefill, decode = pair
    sender = prefill.sender(8)
    sender.init(2)
    sender.abort("prefill preempted")
    receiver = decode.receiver(8, prefill.bootstrap_addr)
    receiver.init()
    receiver.post_buffers([0, 1])
    wait_until(lambda: ended(receiver), 5, "the refusal")
    assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, "peer aborted: prefill preempted")


def test_an_address_the_socket_refuses_fails_its_room_only(pair):
    """A bootstrap address zmq cannot connect to (the engine's validation refuses such hosts
    first; this is the transport's own guard) fails that receiver; the transport thread lives on
    and the next room transfers. It once crashed the thread: every later room failed."""
    prefill, decode = pair
    bad = decode.receiver(20, "a b:1")
    bad.init()
    wait_until(lambda: ended(bad), 5, "the refusal")
    assert bad.poll() == KVPoll.Failed and bad.failure.startswith("cannot connect to the prefill side at a b:1")
    sender, receiver = start(prefill, decode, 21, [0, 1], [2, 3])
    wait_until(lambda: ended(sender) and ended(receiver), 5, "the next room's transfer")
    assert sender.poll() == receiver.poll() == KVPoll.Success


def test_a_second_request_in_an_open_room_is_refused_on_the_prefill_side(pair):
    """Two prefill requests with one room: the second fails, and the room's decode side gets the
    first one's rows (the second once replaced the first: its peer got the other prompt's KV)."""
    prefill, decode = pair
    first, receiver = start(prefill, decode, 22, [0, 1], [2, 3], send=False)
    second = prefill.sender(22)
    second.init(2)
    wait_until(lambda: ended(second), 5, "the refusal")
    assert second.failure == "room 22 is open already on this prefill side"
    first.send([0, 1], Aux(22))
    wait_until(lambda: ended(first) and ended(receiver), 5, "the first one's transfer")
    assert first.poll() == receiver.poll() == KVPoll.Success


def test_a_page_count_mismatch_fails_both_sides(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 10, [0, 1, 2], [3, 4])
    wait_until(lambda: ended(sender) and ended(receiver), 5, "the mismatch")
    reason = "page count mismatch: the prefill sends 3 pages, the decode side posted 2"
    assert (sender.failure, receiver.failure) == (reason, reason)


# only the side that notices presumes silence early, and after 3 s, not less: the closing side's
# room must not fail before it closes, by its own silence verdict or by the other side's Abort
# after a pause of this process
@pytest.mark.parametrize("pair", [{"prefill": {"heartbeat_misses": 14}}], indirect=True)
def test_closing_a_transport_fails_its_open_rooms_and_refuses_new_ones(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 11, [0, 1], [2, 3], send=False)
    wait_until(lambda: receiver.poll() == KVPoll.WaitingForInput, 5, "the welcome")
    decode.close()
    assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, "transport closed")
    late = decode.receiver(12, prefill.bootstrap_addr)
    late.init()
    assert (late.poll(), late.failure) == (KVPoll.Failed, "transport closed")
    wait_until(lambda: ended(sender), 10, "the sender to notice the decode side is gone")
    assert "silent" in sender.failure, sender.failure


def test_a_second_decode_request_for_a_room_is_refused_and_the_first_goes_on(pair):
    prefill, decode = pair
    other = TcpDecodeTransport(DisaggConfig("decode", **FAST), make_layers(3, POOL))
    try:
        first = decode.receiver(15, prefill.bootstrap_addr)
        first.init()
        first.post_buffers([0, 1])
        wait_until(lambda: first.poll() == KVPoll.WaitingForInput, 5, "the first registration")
        second = other.receiver(15, prefill.bootstrap_addr)
        second.init()
        second.post_buffers([2, 3])
        wait_until(lambda: ended(second), 5, "the refusal")
        assert second.failure == "room 15 is registered already by another decode request"
        sender = prefill.sender(15)
        sender.init(2)
        sender.send([4, 5], Aux(3))
        wait_until(lambda: ended(first) and ended(sender), 5, "the first room's transfer")
        assert first.poll() == sender.poll() == KVPoll.Success
    finally:
        other.close()


def test_garbage_on_the_bootstrap_port_is_dropped_and_the_server_stays_up(pair, caplog):
    prefill, decode = pair
    ctx = zmq.Context()
    try:
        stray = ctx.socket(zmq.DEALER)
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(f"tcp://{prefill.bootstrap_addr}")
        stray.send(b"\x93not msgpack of ours")
        stray.send_multipart([b"two", b"frames"])
        wait_until(lambda: "dropped a message of 3 frames" in caplog.text, 5, "the server to drop the garbage")
        assert "dropped a malformed message" in caplog.text
        sender, receiver = start(prefill, decode, 16, [0, 1], [2, 3])
        wait_until(lambda: ended(sender) and ended(receiver), 5, "a transfer after the garbage")
        assert sender.poll() == receiver.poll() == KVPoll.Success
        stray.close(0)
    finally:
        ctx.term()


def test_bad_page_lists_are_refused_at_the_call():
    config = {**FAST}
    prefill = TcpPrefillTransport(DisaggConfig("prefill", **config), make_layers(1, POOL))
    decode = TcpDecodeTransport(DisaggConfig("decode", **config), make_layers(2, POOL))
    try:
        receiver = decode.receiver(13, prefill.bootstrap_addr)
        with pytest.raises(RuntimeError, match="post_buffers before init"):
            receiver.post_buffers([1])
        receiver.init()
        with pytest.raises(ValueError, match="dst_pages: page ids must be distinct"):
            receiver.post_buffers([1, 1])
        sender = prefill.sender(13)
        sender.init(2)
        with pytest.raises(ValueError, match=r"src_pages: one or more page ids in \[0, 12\)"):
            sender.send([0, 12], Aux(0))
        with pytest.raises(ValueError, match="bootstrap_addr"):
            decode.receiver(14, "nohost")
    finally:
        prefill.close()
        decode.close()
