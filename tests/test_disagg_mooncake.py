"""The mooncake KV transport (the Mooncake transfer engine, tcp transport, P2P handshake, host
memory): rows arrive byte for byte between two processes and among many rooms; layout, model,
backend and page-count refusals; aborts, timeouts and close fail both sides; and a READ that
cannot complete (its pool's process stopped) neither keeps the receiver from failing nor writes
the pages after Failed, while the prefill side hears of it only once the READ is over (its
pages are read until then). Skipped without the mooncake-transfer-engine package."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys

import pytest
import torch
import zmq

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed: `bash scripts/setup.sh "
                                              "--test` installs it (pip install mooncake-transfer-engine-non-cuda)")

from disagg_peer import make_layers, mooncake_pool_main, read_between_two_processes, wait_until  # noqa: E402
from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport  # noqa: E402
from ketch.disagg.layout import layout_of  # noqa: E402
from ketch.disagg.mooncake_engine import read_plan  # noqa: E402
from ketch.disagg.wire import (Abort, Heartbeat, Hello, Post, Ready, Released, Welcome, decode_to_decode,  # noqa: E402
                               decode_to_prefill, encode)

POOL = 16
SRC = [5, 6, 7, 0, 11, 3]  # a run of three pages, then single ones
DST = [9, 1, 14, 4, 12, 2]
# heartbeats flow, but a peer is presumed dead only after 30 s of silence: a pause of the test
# process (a garbage collection late in the suite) is no dead peer; tests about silence shorten it
CONFIG = dict(transfer_backend="mooncake", bootstrap_port=0, heartbeat_interval_s=0.3, heartbeat_misses=100,
              bootstrap_timeout_s=30.0, waiting_timeout_s=30.0, transfer_timeout_s=30.0)


def ended(side) -> bool:
    return side.poll() in (KVPoll.Success, KVPoll.Failed)


def snapshot(layers):
    return [{k: t.clone() for k, t in layer.items()} for layer in layers]


def assert_same(layers, before) -> None:
    for layer, old in zip(layers, before, strict=True):
        for name, t in layer.items():
            assert torch.equal(t.view(torch.uint8), old[name].view(torch.uint8)), f"{name} changed"


@pytest.fixture
def pair(request):
    """A prefill and a decode transport in this process; `param` overrides the config (its
    "prefill" / "decode" dicts only that side's)."""
    opts = dict(getattr(request, "param", {}))
    only = {mode: opts.pop(mode, {}) for mode in ("prefill", "decode")}
    sides = {mode: {**CONFIG, **opts, **only[mode]} for mode in ("prefill", "decode")}
    prefill = make_transport(DisaggConfig("prefill", **sides["prefill"]), make_layers(1, POOL))
    decode = make_transport(DisaggConfig("decode", **sides["decode"]), make_layers(2, POOL))
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
        sender.send(src, Aux(room % 1000, b"state"))
    return sender, receiver


def test_the_read_plan_is_one_entry_per_run_of_source_pages_per_tensor():
    layout = layout_of(make_layers(0, 4, num_layers=1))  # k and v, 4 x 2 x 8 float32: 256-byte rows
    plan = read_plan(layout, [1000, 9000], [2, 3, 0, 1])
    assert plan.row_bytes == [256, 256] and plan.offsets == [0, 1024] and plan.total == 2048
    assert (plan.local, plan.remote, plan.lengths) == ([0, 512, 1024, 1536], [1512, 1000, 9512, 9000],
                                                       [512, 512, 512, 512])


def test_a_read_between_two_processes_moves_the_rows_byte_for_byte():
    read_between_two_processes(CONFIG, POOL, SRC, DST)


def test_many_rooms_at_once_in_bfloat16_each_gets_its_own_rows():
    src_layers = make_layers(1, 64, num_layers=3, dtype=torch.bfloat16)
    dst_layers = make_layers(2, 64, num_layers=3, dtype=torch.bfloat16)
    prefill = make_transport(DisaggConfig("prefill", **CONFIG), src_layers)
    decode = make_transport(DisaggConfig("decode", **CONFIG), dst_layers)
    try:
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
        rooms = {room: (list(range(4 * i, 4 * i + 3)) if i % 2 else perm[40 + i:43 + i], perm[4 * i:4 * i + 3])
                 for i, room in enumerate(range(100, 108))}
        pairs = [start(prefill, decode, room, src, dst) for room, (src, dst) in rooms.items()]
        for sender, receiver in pairs:
            wait_until(lambda: ended(sender) and ended(receiver), 30, f"room {sender.room}")
            assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success), (sender.failure, receiver.failure)
            assert receiver.aux == Aux(sender.room % 1000, b"state")
        for src, dst in rooms.values():
            for layer in range(3):
                for name in ("k", "v"):
                    assert torch.equal(dst_layers[layer][name][dst].view(torch.uint8),
                                       src_layers[layer][name][src].view(torch.uint8))
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("field, decode_layers, model, expected", [
    ("page_size", make_layers(2, POOL, page_size=8), "m", "page_size is 4 at the prefill side, 8 at the decode side"),
    ("model", make_layers(2, POOL), "other", "model is 'm' at the prefill side, 'other' at the decode side"),
], ids=["page_size", "model"])
def test_a_decode_side_of_another_layout_or_model_is_refused_on_both_sides(field, decode_layers, model, expected):
    prefill = make_transport(DisaggConfig("prefill", **CONFIG), make_layers(1, POOL), "m")
    decode = make_transport(DisaggConfig("decode", **CONFIG), decode_layers, model)
    before = snapshot(decode_layers)
    try:
        sender, receiver = start(prefill, decode, 1, [0, 1], [2, 3])
        wait_until(lambda: ended(sender) and ended(receiver), 10, "the refusal")
        assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, f"layout mismatch: {expected}")
        assert (sender.poll(), sender.failure) == (KVPoll.Failed, f"layout mismatch: {expected}")
        assert_same(decode_layers, before)
    finally:
        prefill.close()
        decode.close()


def test_a_tcp_decode_side_is_refused_by_a_mooncake_prefill_side():
    prefill = make_transport(DisaggConfig("prefill", **CONFIG), make_layers(1, POOL))
    decode = make_transport(DisaggConfig("decode", **{**CONFIG, "transfer_backend": "tcp"}), make_layers(2, POOL))
    try:
        sender, receiver = start(prefill, decode, 3, [0], [0])
        wait_until(lambda: ended(receiver) and ended(sender), 10, "the refusal")
        expected = "backend mismatch: 'mooncake' at the prefill side, 'tcp' at the decode side"
        assert receiver.failure == sender.failure == expected
    finally:
        prefill.close()
        decode.close()


def test_a_page_count_mismatch_fails_both_sides(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 10, [0, 1, 2], [3, 4])
    wait_until(lambda: ended(sender) and ended(receiver), 5, "the mismatch")
    reason = "page count mismatch: the prefill sends 3 pages, the decode side posted 2"
    assert (sender.failure, receiver.failure) == (reason, reason)


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


@pytest.mark.parametrize("pair", [{"waiting_timeout_s": 0.5}], indirect=True)
def test_a_prefill_that_never_sends_fails_both_sides_at_the_waiting_timeout(pair):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 5, [0, 1], [2, 3], send=False)
    wait_until(lambda: ended(sender) and ended(receiver), 5, "the waiting timeout")
    reasons = ("WaitingForInput timed out after 0.5 s", "peer failed: WaitingForInput timed out after 0.5 s")
    assert sender.failure in reasons and receiver.failure in reasons
    assert KVPoll.Failed == sender.poll() == receiver.poll()


# only the side that notices presumes silence early, and after 3 s, not less: the closing side's
# room must not fail before it closes, by its own silence verdict or by the other side's Abort
# after a pause of this process
@pytest.mark.parametrize(("pair", "side"), [({"prefill": {"heartbeat_misses": 9}}, "decode"),
                                            ({"decode": {"heartbeat_misses": 9}}, "prefill")], indirect=["pair"])
def test_closing_a_transport_fails_its_open_rooms_and_the_peer_hears_silence(pair, side):
    prefill, decode = pair
    sender, receiver = start(prefill, decode, 11, [0, 1], [2, 3], send=False)
    wait_until(lambda: receiver.poll() == KVPoll.WaitingForInput, 5, "the welcome")
    closing, mine, other = (decode, receiver, sender) if side == "decode" else (prefill, sender, receiver)
    closing.close()
    assert (mine.poll(), mine.failure) == (KVPoll.Failed, "transport closed")
    if side == "decode":
        late = decode.receiver(12, prefill.bootstrap_addr)
        late.init()
    else:
        late = prefill.sender(12)
        late.init(1)
    assert (late.poll(), late.failure) == (KVPoll.Failed, "transport closed")
    wait_until(lambda: ended(other), 10, "the other side to notice the closed one is gone")
    assert "silent" in other.failure, other.failure


def test_without_the_package_the_backend_says_so_at_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # an import of it now fails as if absent
    with pytest.raises(RuntimeError, match="transfer_backend 'mooncake' needs the Mooncake transfer engine"):
        make_transport(DisaggConfig("decode", **CONFIG), make_layers(2, POOL))


class HandReader:
    """A decode side speaking the wire protocol by hand: takes a Ready and does not READ."""

    def __init__(self, addr: str, room: int, layers) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{addr}")
        self.sock.send(encode(Hello(room, layout_of(layers), "mooncake")))
        self.sock.send(encode(Post(room, [0, 1])))

    def expect(self, kind: type, timeout_s: float = 10):
        while True:  # heartbeats in between are skipped
            assert self.sock.poll(timeout_s * 1000), f"no {kind.__name__} within {timeout_s} s"
            msg = decode_to_decode(self.sock.recv())
            if isinstance(msg, kind):
                return msg

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_an_aborted_sender_keeps_its_pages_until_the_reader_says_released():
    layers = make_layers(1, POOL)
    prefill = make_transport(DisaggConfig("prefill", **CONFIG), layers)
    reader = HandReader(prefill.bootstrap_addr, 4, layers)
    try:
        assert reader.expect(Welcome).mooncake is not None
        sender = prefill.sender(4)
        sender.init(2)
        sender.send([3, 4], Aux(9))
        assert reader.expect(Ready).src_pages == [3, 4]
        sender.abort("client went away")
        assert reader.expect(Abort).reason == "peer aborted: client went away"
        assert sender.poll() == KVPoll.Transferring  # not Failed: the pages may still be read
        reader.sock.send(encode(Released(4)))
        wait_until(lambda: ended(sender), 5, "Released to land")
        assert (sender.poll(), sender.failure) == (KVPoll.Failed, "aborted: client went away")
    finally:
        reader.close()
        prefill.close()


@pytest.mark.parametrize("cause", ["abort", "timeout"])
def test_a_read_that_cannot_complete_fails_the_receiver_at_once_and_never_writes_its_pages(cause):
    """The prefill's engine lives in a process the test has stopped (SIGSTOP), so the decode
    side's READ hangs; the control plane is spoken by hand from here. The receiver fails at once
    (the READ fills only its staging buffer), the prefill side hears of it only when the READ is
    over (after SIGCONT), and the rows the READ then fetched never reach the pages."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    pool = ctx.Process(target=mooncake_pool_main, args=(1, POOL, out), daemon=True)
    pool.start()
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    layers = make_layers(2, POOL)
    before = snapshot(layers)
    limit = 0.5 if cause == "timeout" else 30.0
    config = {**CONFIG, "heartbeat_interval_s": 30.0, "transfer_timeout_s": limit}  # the timeout decides, not silence
    decode = make_transport(DisaggConfig("decode", **config), layers)
    try:
        kind, peer = out.get(timeout=60)
        os.kill(pool.pid, signal.SIGSTOP)
        receiver = decode.receiver(5, f"127.0.0.1:{port}")
        receiver.init()
        receiver.post_buffers([1, 2])

        def next_message(timeout_s: float = 10):
            while True:
                if not router.poll(timeout_s * 1000):
                    return None, None
                ident, data = router.recv_multipart()
                msg = decode_to_prefill(data)
                if not isinstance(msg, Heartbeat):
                    return ident, msg

        ident, hello = next_message()
        assert isinstance(hello, Hello) and isinstance(next_message()[1], Post)
        router.send_multipart([ident, encode(Welcome(5, mooncake=peer))])
        router.send_multipart([ident, encode(Ready(5, [3, 4], Aux(1)))])
        # past WaitingForInput: the READ started (with the 0.5 s limit it may have timed out already,
        # if this process paused; the reason asserted below says it was Transferring)
        wait_until(lambda: receiver.poll() not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput), 10,
                   "the READ to start")
        if cause == "abort":
            receiver.abort("client went away")
        wait_until(lambda: ended(receiver), 5, "the receiver to fail")
        expected = "aborted: client went away" if cause == "abort" else "Transferring timed out after 0.5 s"
        assert (receiver.poll(), receiver.failure) == (KVPoll.Failed, expected)
        assert next_message(1.0) == (None, None)  # the READ still runs: its pages are still being read
        os.kill(pool.pid, signal.SIGCONT)
        _, told = next_message(90)
        if cause == "abort":
            assert told == Abort(5, "peer aborted: client went away")
        else:
            assert told == Abort(5, "peer failed: Transferring timed out after 0.5 s")
        assert_same(layers, before)
    finally:
        pool.kill()
        pool.join(10)
        decode.close()
        router.close(0)
        zctx.term()
