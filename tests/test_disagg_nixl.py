"""The nixl KV transport (NIXL over UCX, tcp transport, host memory): a transfer between two
processes byte for byte, a prefill side that restarts, a tcp decode side refused by name, and
the rule that a prefill side whose pages a decode side may be reading fails only once that side
stopped (PRIOR_ART known failure 5: never hand back pages a peer may still be reading).
Skipped without the nixl package."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch
import zmq

pytest.importorskip("nixl")
os.environ.setdefault("UCX_TLS", "tcp")  # before any agent starts UCX; spawned children inherit it

from disagg_peer import make_layers, nixl_pool_main, read_between_two_processes, wait_until  # noqa: E402
from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport  # noqa: E402
from ketch.disagg.layout import layout_of  # noqa: E402
from ketch.disagg.wire import (Abort, Heartbeat, Hello, Post, Ready, Released, Welcome, decode_to_decode,  # noqa: E402
                               decode_to_prefill, encode)

POOL = 16
SRC = [5, 0, 11, 3, 7, 2]
DST = [9, 1, 14, 4, 12, 6]
# heartbeats flow, but a peer is presumed dead only after 30 s of silence: a pause of the test
# process (a garbage collection late in the suite) is no dead peer; tests about silence shorten it
CONFIG = dict(transfer_backend="nixl", bootstrap_port=0, heartbeat_interval_s=0.3, heartbeat_misses=100,
              bootstrap_timeout_s=30.0, waiting_timeout_s=30.0, transfer_timeout_s=30.0)


def ended(side) -> bool:
    return side.poll() in (KVPoll.Success, KVPoll.Failed)


def receive(decode, addr: str, room: int, dst: list[int]):
    receiver = decode.receiver(room, addr)
    receiver.init()
    receiver.post_buffers(dst)
    return receiver


def test_a_read_between_two_processes_moves_the_rows_byte_for_byte():
    read_between_two_processes(CONFIG, POOL, SRC, DST)


def test_a_restarted_prefill_side_is_a_new_agent_and_the_decode_side_goes_on():
    """PRIOR_ART known failure 6: a prefill restart crashed decode servers (stale NIXL metadata)."""
    src, dst = make_layers(1, POOL), make_layers(2, POOL)
    decode = make_transport(DisaggConfig("decode", **CONFIG), dst)
    first = make_transport(DisaggConfig("prefill", **CONFIG), src)
    addr = first.bootstrap_addr
    try:
        for room, prefill in ((1, first), (2, None)):
            if prefill is None:  # the same address, another process's agent
                first.close()
                prefill = make_transport(DisaggConfig("prefill", **{**CONFIG, "bootstrap_port": int(addr.split(":")[1])}),
                                         src)
            sender = prefill.sender(room)
            sender.init(2)
            sender.send([room, room + 4], Aux(room))
            receiver = receive(decode, addr, room, [room + 8, room + 10])
            wait_until(lambda: ended(sender) and ended(receiver), 20, f"room {room}")
            assert sender.poll() == receiver.poll() == KVPoll.Success, (sender.failure, receiver.failure)
            assert torch.equal(dst[1]["v"][[room + 8, room + 10]], src[1]["v"][[room, room + 4]])
        prefill.close()
    finally:
        first.close()
        decode.close()


def test_a_tcp_decode_side_is_refused_by_a_nixl_prefill_side():
    prefill = make_transport(DisaggConfig("prefill", **CONFIG), make_layers(1, POOL))
    decode = make_transport(DisaggConfig("decode", **{**CONFIG, "transfer_backend": "tcp"}), make_layers(2, POOL))
    try:
        receiver = receive(decode, prefill.bootstrap_addr, 3, [0])
        wait_until(lambda: ended(receiver), 10, "the refusal")
        assert receiver.failure == "backend mismatch: 'nixl' at the prefill side, 'tcp' at the decode side"
    finally:
        prefill.close()
        decode.close()


class SlowReader:
    """A decode side speaking the wire protocol by hand that takes a Ready and does not READ yet:
    the prefill side cannot know whether its pages are being read."""

    def __init__(self, addr: str, room: int, layers) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{addr}")
        self.room = room
        self.sock.send(encode(Hello(room, layout_of(layers), "nixl")))
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


@pytest.mark.parametrize("answer", ["released", "silence"])
def test_an_aborted_sender_keeps_its_pages_until_the_reader_stopped(answer):
    # the reader sends no heartbeats: with "released" only Released can end the wait within 30 s;
    # with "silence" it is presumed dead 2 s after its last word (not less: the steps before the
    # abort must not outlast it if this process pauses)
    config = {**CONFIG, "heartbeat_interval_s": 0.2, "heartbeat_misses": 9 if answer == "silence" else 150}
    layers = make_layers(1, POOL)
    prefill = make_transport(DisaggConfig("prefill", **config), layers)
    reader = SlowReader(prefill.bootstrap_addr, 4, layers)
    try:
        assert reader.expect(Welcome).nixl is not None
        sender = prefill.sender(4)
        sender.init(2)
        sender.send([3, 4], Aux(9))
        assert reader.expect(Ready).src_pages == [3, 4]
        sender.abort("client went away")
        assert reader.expect(Abort).reason == "peer aborted: client went away"
        assert sender.poll() == KVPoll.Transferring  # not Failed: the pages may still be read
        if answer == "released":
            reader.sock.send(encode(Released(4)))
            wait_until(lambda: ended(sender), 5, "Released to land")
        else:  # the reader says nothing more: presumed dead after the heartbeat allowance
            took = wait_until(lambda: ended(sender), 10, "the reader's silence to count")
            assert took >= 0.2
        assert (sender.poll(), sender.failure) == (KVPoll.Failed, "aborted: client went away")
    finally:
        reader.close()
        prefill.close()


@pytest.mark.parametrize("cause", ["abort", "timeout"])
def test_a_read_in_flight_is_stopped_before_the_receiver_fails(cause):
    """The prefill's NIXL agent lives in a process the test has stopped (SIGSTOP), so the decode
    side's READ cannot complete; the control plane is spoken by hand from here. The receiver may
    fail only once the READ can no longer write its pages, and the prefill side hears of it only then."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    pool = ctx.Process(target=nixl_pool_main, args=(1, POOL, out), daemon=True)
    pool.start()
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    layers = make_layers(2, POOL)
    before = [{k: t.clone() for k, t in layer.items()} for layer in layers]
    limit = 0.5 if cause == "timeout" else 30.0
    config = {**CONFIG, "heartbeat_interval_s": 30.0, "transfer_timeout_s": limit}  # the READ hangs; no heartbeat verdict
    decode = make_transport(DisaggConfig("decode", **config), layers)
    try:
        kind, peer = out.get(timeout=60)
        os.kill(pool.pid, signal.SIGSTOP)
        receiver = receive(decode, f"127.0.0.1:{port}", 5, [1, 2])

        def next_message():
            while True:
                assert router.poll(10_000), "the decode side said nothing"
                ident, data = router.recv_multipart()
                msg = decode_to_prefill(data)
                if not isinstance(msg, Heartbeat):
                    return ident, msg

        ident, hello = next_message()
        assert isinstance(hello, Hello) and isinstance(next_message()[1], Post)
        router.send_multipart([ident, encode(Welcome(5, peer))])
        router.send_multipart([ident, encode(Ready(5, [3, 4], Aux(1)))])
        # past WaitingForInput: the READ started (with the 0.5 s limit it may have timed out already,
        # if this process paused; the reason asserted below says it was Transferring)
        wait_until(lambda: receiver.poll() not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput), 10,
                   "the READ to start")
        if cause == "abort":
            receiver.abort("client went away")
        _, told = next_message()
        assert receiver.poll() == KVPoll.Failed  # the prefill side is told only once the pages are quiet
        if cause == "abort":
            assert (receiver.failure, told) == ("aborted: client went away", Abort(5, "peer aborted: client went away"))
        else:
            assert (receiver.failure, told) == ("Transferring timed out after 0.5 s",
                                                Abort(5, "peer failed: Transferring timed out after 0.5 s"))
        for layer in range(2):
            for name in ("k", "v"):
                assert torch.equal(layers[layer][name], before[layer][name])
    finally:
        pool.kill()
        pool.join(10)
        decode.close()
        router.close(0)
        zctx.term()
