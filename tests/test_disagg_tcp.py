"""The tcp KV transport between two real OS processes (issue 17): a prefill side and a decode
side with pools built from seeds, the rows of posted pages compared byte for byte; a byte flipped
on the wire; each side SIGKILLed in the middle of a transfer. The far side runs in a spawned
process (tests/disagg_peer.py); this process runs the other side and holds the pages it checks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading

import pytest
import torch

from disagg_peer import decode_main, make_layers, prefill_main, wait_until
from ketch.disagg import Aux, DisaggConfig, KVPoll
from ketch.disagg.tcp_decode import TcpDecodeTransport
from ketch.disagg.tcp_prefill import TcpPrefillTransport

POOL = 16
SRC = [5, 0, 11, 3, 7, 2]
DST = [9, 1, 14, 4, 12, 6]
# one page row of every tensor of one layer is 2 x 4 x 2 x 8 x 4 = 512 bytes: 1,024-byte chunks cut
# each layer into three chunks (six in all) and a window of two makes the sender wait for credits.
# heartbeats flow (0.3 s) but a peer is presumed dead only after 30 s of silence: a pause of the test
# process (a garbage collection late in the suite) is no dead peer; tests about silence shorten it
CONFIG = dict(bootstrap_port=0, chunk_bytes=1024, window_chunks=2, heartbeat_interval_s=0.3, heartbeat_misses=100,
              bootstrap_timeout_s=30.0, waiting_timeout_s=30.0, transfer_timeout_s=30.0)
SHORT = {**CONFIG, "heartbeat_misses": 3}  # the tests of a killed peer: silent after 1.2 s
SILENCE = DisaggConfig("decode", **SHORT).peer_silence_s
ROOM = 0x5EED_0000_0001


@pytest.fixture
def spawn():
    """Start a process on the spawn context; whatever is still alive at the end is killed."""
    ctx = mp.get_context("spawn")
    started: list[mp.Process] = []

    def start(target, *args) -> tuple[mp.Process, mp.Queue]:
        out = ctx.Queue()
        proc = ctx.Process(target=target, args=(*args, out), daemon=True)
        proc.start()
        started.append(proc)
        return proc, out

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def expect(out: mp.Queue, kind: str, timeout_s: float = 60) -> tuple:
    msg = out.get(timeout=timeout_s)
    assert msg[0] == kind, f"expected {kind!r} from the peer, got {msg!r}"
    return msg


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_moved(dst: list[dict[str, torch.Tensor]], before: list[dict[str, torch.Tensor]],
                 src: list[dict[str, torch.Tensor]]) -> None:
    untouched = torch.ones(POOL, dtype=torch.bool)
    untouched[DST] = False
    for layer in range(len(dst)):
        for name in dst[layer]:
            assert torch.equal(as_bytes(dst[layer][name][DST]), as_bytes(src[layer][name][SRC])), (layer, name)
            assert torch.equal(as_bytes(dst[layer][name][untouched]), as_bytes(before[layer][name][untouched]))


def decode_side(addr: str, config: dict = CONFIG) -> tuple[TcpDecodeTransport, object, list, list]:
    layers = make_layers(2, POOL)
    before = [{k: t.clone() for k, t in layer.items()} for layer in layers]
    transport = TcpDecodeTransport(DisaggConfig("decode", **config), layers)
    receiver = transport.receiver(ROOM, addr)
    receiver.init()
    receiver.post_buffers(DST)
    return transport, receiver, layers, before


def ended(side) -> bool:
    return side.poll() in (KVPoll.Success, KVPoll.Failed)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_posted_pages_get_the_senders_rows_byte_for_byte(spawn, host):
    """Over IPv4 and IPv6 loopback (the prefill side binds `::1`, the decode side connects to the
    address it gives: ZMQ needs IPv6 on and the address in brackets, or neither end works)."""
    if ":" in host and not _ipv6_loopback():
        pytest.skip("this machine has no IPv6 loopback")
    proc, out = spawn(prefill_main, {**CONFIG, "bootstrap_host": host}, 1, POOL, ROOM, SRC, 42, None)
    transport, receiver, layers, before = decode_side(expect(out, "addr")[1])
    try:
        wait_until(lambda: ended(receiver), 30, "the transfer")
        assert receiver.poll() == KVPoll.Success, receiver.failure
        assert receiver.aux == Aux(42, b"sampling-state")
        assert_moved(layers, before, make_layers(1, POOL))
        assert expect(out, "final") == ("final", "Success", None)
    finally:
        transport.close()
    proc.join(10)
    assert proc.exitcode == 0


def test_a_bootstrap_address_that_cannot_be_bound_names_the_flags():
    """An address this machine does not have (TEST-NET-1): a ValueError naming the options, not a
    raw ZMQError from the socket."""
    with pytest.raises(ValueError, match="disaggregation_bootstrap_host / _port: cannot listen on 192.0.2.1:0"):
        TcpPrefillTransport(DisaggConfig("prefill", **{**CONFIG, "bootstrap_host": "192.0.2.1"}), make_layers(1, POOL))


def test_a_byte_flipped_on_the_wire_fails_both_sides_with_the_checksum(spawn):
    proc, out = spawn(prefill_main, CONFIG, 1, POOL, ROOM, SRC, 42, "flip:1")
    transport, receiver, layers, before = decode_side(expect(out, "addr")[1])
    try:
        wait_until(lambda: ended(receiver), 30, "the transfer to fail")
        assert receiver.poll() == KVPoll.Failed
        assert receiver.failure.startswith("checksum mismatch in chunk 1"), receiver.failure
        assert receiver.aux is None
        _, state, reason = expect(out, "final")
        assert (state, reason) == ("Failed", f"peer failed: {receiver.failure}")
        src = make_layers(1, POOL)
        untouched = torch.ones(POOL, dtype=torch.bool)
        untouched[DST] = False
        for name in ("k", "v"):  # chunk 0 (layer 0, pages 0-1) was written; chunk 1 (pages 2-3) never was
            assert torch.equal(layers[0][name][DST[:2]], src[0][name][SRC[:2]])
            assert torch.equal(layers[0][name][DST[2:4]], before[0][name][DST[2:4]])
            for layer in range(2):  # and nothing outside the posted pages
                assert torch.equal(layers[layer][name][untouched], before[layer][name][untouched])
    finally:
        transport.close()


def test_a_prefill_killed_mid_transfer_fails_the_decode_side_within_the_heartbeat(spawn):
    proc, out = spawn(prefill_main, SHORT, 1, POOL, ROOM, SRC, 42, "stall:2")
    transport, receiver, _, _ = decode_side(expect(out, "addr")[1], SHORT)
    try:
        expect(out, "stalled")
        wait_until(lambda: receiver.poll() not in (KVPoll.Bootstrapping, KVPoll.WaitingForInput), 30, "chunk 0")
        os.kill(proc.pid, signal.SIGKILL)
        took = wait_until(lambda: ended(receiver), SILENCE + 5, "the decode side to give up")
        assert receiver.poll() == KVPoll.Failed
        assert "silent" in receiver.failure, receiver.failure
        print(f"decode side failed after {took:.2f} s: {receiver.failure}")
        assert took < SILENCE + 5
    finally:
        transport.close()


def test_a_decode_killed_mid_transfer_fails_the_prefill_side_within_the_heartbeat(spawn):
    release = threading.Event()

    def hold_chunk_2(seq: int, frames: list) -> list:
        if seq == 2:
            release.wait(30)  # the decode process dies while the sender is between chunks
        return frames

    transport = TcpPrefillTransport(DisaggConfig("prefill", **SHORT), make_layers(1, POOL), wire_hook=hold_chunk_2)
    try:
        sender = transport.sender(ROOM)
        sender.init(len(SRC))
        sender.send(SRC, Aux(7))
        proc, out = spawn(decode_main, SHORT, 2, POOL, ROOM, transport.bootstrap_addr, DST)
        expect(out, "transferring")
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        release.set()
        took = wait_until(lambda: ended(sender), SILENCE + 5, "the prefill side to give up")
        assert sender.poll() == KVPoll.Failed
        assert "silent" in sender.failure or "unreachable" in sender.failure, sender.failure
        print(f"prefill side failed after {took:.2f} s: {sender.failure}")
        assert took < SILENCE + 5
    finally:
        release.set()
        transport.close()
