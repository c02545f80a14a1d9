"""The transfer state machine (ketch/disagg/state.py), its config, and the `fake` backend that
moves no bytes: the same states, aborts and timeouts as the real backends, for tests and warm-up."""
from __future__ import annotations

import time

import pytest

from disagg_peer import wait_until
from ketch.disagg import Aux, DisaggConfig, KVPoll, make_transport
from ketch.disagg.fake import FakeHub
from ketch.disagg.state import TransferState


def fake_pair(**overrides):
    hub = FakeHub()
    prefill = make_transport(DisaggConfig("prefill", transfer_backend="fake", **overrides), [], hub=hub)
    decode = make_transport(DisaggConfig("decode", transfer_backend="fake", **overrides), [], hub=hub)
    return prefill, decode


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("field, value", [
    ("mode", "both"), ("transfer_backend", "rdma"), ("bootstrap_host", ""),
    ("bootstrap_port", 70000), ("bootstrap_port", -1), ("bootstrap_timeout_s", 0), ("waiting_timeout_s", -1.0),
    ("transfer_timeout_s", "5"), ("heartbeat_interval_s", True), ("heartbeat_misses", 0), ("chunk_bytes", 0),
    ("window_chunks", 1.5),
])
def test_a_bad_config_value_is_refused_naming_its_field(field, value):
    values = {"mode": "prefill", field: value}
    with pytest.raises(ValueError, match=f"^{field}: "):
        DisaggConfig(**values)


def test_the_config_is_frozen_and_defaults_to_sglangs_timeouts():
    config = DisaggConfig("decode")
    assert (config.bootstrap_timeout_s, config.waiting_timeout_s, config.heartbeat_interval_s) == (300.0, 300.0, 5.0)
    assert config.peer_silence_s == 15.0
    with pytest.raises(AttributeError):
        config.mode = "prefill"


# ---------------------------------------------------------------- the state machine
def test_states_only_move_forward_and_the_first_failure_sticks():
    state = TransferState({KVPoll.Bootstrapping: 5.0})
    assert state.state == KVPoll.Bootstrapping
    assert state.advance(KVPoll.Transferring)  # a skip forward is allowed
    assert not state.advance(KVPoll.WaitingForInput)  # back is not
    assert not state.advance(KVPoll.Failed)  # failing takes a reason
    assert state.fail("first") and not state.fail("second")
    assert (state.state, state.reason) == (KVPoll.Failed, "first")
    assert not state.advance(KVPoll.Success)
    assert state.expired(time.monotonic() + 1e6) is None  # a terminal state has no deadline


def test_a_state_expires_after_its_own_timeout_only():
    state = TransferState({KVPoll.Bootstrapping: 5.0, KVPoll.Transferring: 1.0})
    now = time.monotonic()
    assert state.expired(now) is None
    assert state.expired(now + 6) == "Bootstrapping timed out after 5 s"
    state.advance(KVPoll.WaitingForInput)  # no limit there
    assert state.expired(now + 1e6) is None
    state.advance(KVPoll.Transferring)
    assert state.expired(time.monotonic() + 2) == "Transferring timed out after 1 s"


# ---------------------------------------------------------------- fake
@pytest.mark.parametrize("order", ["decode first", "prefill first"])
def test_fake_pairs_reach_success_together_whoever_comes_first(order):
    prefill, decode = fake_pair()
    sender, receiver = prefill.sender(1), decode.receiver(1, prefill.bootstrap_addr)
    steps = [receiver.init, lambda: receiver.post_buffers([4, 5]), lambda: sender.init(2)]
    for step in steps if order == "decode first" else steps[2:] + steps[:2]:
        step()
    assert sender.poll() == receiver.poll() == KVPoll.WaitingForInput
    assert receiver.aux is None
    sender.send([0, 1], Aux(17, b"x"))
    assert sender.poll() == receiver.poll() == KVPoll.Success
    assert receiver.aux == Aux(17, b"x")


def test_fake_sender_without_a_peer_is_a_warm_up():
    transport = make_transport(DisaggConfig("prefill", transfer_backend="fake"), [])
    sender = transport.sender(1)
    assert sender.poll() == KVPoll.Bootstrapping
    sender.init(3)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.send([0, 1, 2], Aux(0))
    assert sender.poll() == KVPoll.Success
    with pytest.raises(RuntimeError, match="send called twice"):
        sender.send([0, 1, 2], Aux(0))


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_fake_abort_fails_the_other_side_too(side):
    prefill, decode = fake_pair()
    sender, receiver = prefill.sender(2), decode.receiver(2, "fake")
    sender.init(1)
    receiver.init()
    receiver.post_buffers([0])
    (sender if side == "sender" else receiver).abort("cancelled")
    other = receiver if side == "sender" else sender
    assert (other.poll(), other.failure) == (KVPoll.Failed, "peer aborted: cancelled")
    sender.send([3], Aux(1))  # too late: nothing moves
    assert receiver.poll() == KVPoll.Failed and receiver.aux is None


def test_fake_timeouts_fail_both_sides():
    prefill, decode = fake_pair(bootstrap_timeout_s=0.05, waiting_timeout_s=0.05)
    lonely = prefill.sender(3)
    lonely.init(1)
    wait_until(lambda: lonely.poll() == KVPoll.Failed, 5, "the bootstrap timeout")
    assert lonely.failure == "Bootstrapping timed out after 0.05 s"
    sender, receiver = prefill.sender(4), decode.receiver(4, "fake")
    sender.init(1)
    receiver.init()
    receiver.post_buffers([0])
    wait_until(lambda: receiver.poll() == KVPoll.Failed, 5, "the waiting timeout")
    assert receiver.failure == "WaitingForInput timed out after 0.05 s"
    assert (sender.poll(), sender.failure) == (KVPoll.Failed, "peer failed: WaitingForInput timed out after 0.05 s")


def test_fake_page_count_mismatch_and_close():
    prefill, decode = fake_pair()
    sender, receiver = prefill.sender(5), decode.receiver(5, "fake")
    sender.init(2)
    receiver.init()
    receiver.post_buffers([0])
    assert sender.failure == receiver.failure == "page count mismatch: sender has 2, receiver posted 1"
    sender, receiver = prefill.sender(6), decode.receiver(6, "fake")
    sender.init(1)
    receiver.init()
    receiver.post_buffers([0])
    decode.close()
    assert (receiver.failure, sender.failure) == ("transport closed", "peer failed: its transport closed")
