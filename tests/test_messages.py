"""The messages between the API and the engine process: SamplingParams on the wire as a typed
struct (the decoder checks types, SamplingParams checks values), and a bad request answered by a
RequestError for its id while the engine keeps serving."""
from __future__ import annotations

import dataclasses
import os
import threading
import typing

import msgspec
import pytest
import zmq
from conftest import make_tiny_engine

from ketch.engine import messages as m
from ketch.engine.outboxes import Outboxes
from ketch.engine.process import _handle, _loop, _Progress
from ketch.sampling.grammar.spec import GrammarSpec
from ketch.sampling.params import SamplingParams
from ketch.server.client import EngineClient

# fields whose wire type is what SamplingParams.__post_init__ makes of them, not what it accepts
NORMALISED = {
    "stop": list[str],
    "stop_token_ids": list[int],
    "grammar": m.WireGrammar | None,
}


def test_wire_struct_has_every_sampling_field_with_its_type():
    want = typing.get_type_hints(SamplingParams)
    have = typing.get_type_hints(m.WireSamplingParams)
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(m.WireSamplingParams.__struct_fields__)
    for name, annotation in want.items():
        assert have[name] == NORMALISED.get(name, annotation), f"WireSamplingParams.{name}: {have[name]}"


def _full_params() -> SamplingParams:
    """Every field away from its default, so a field dropped on the way shows."""
    return SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.1,
                          frequency_penalty=0.5, presence_penalty=-0.5, seed=7, logit_bias={"3": 2},
                          stop="END", stop_token_ids=[4, 5], ignore_eos=True, max_tokens=9, min_tokens=2,
                          logprobs=True, top_logprobs=3, skip_special_tokens=False,
                          grammar=GrammarSpec("regex", "[a-z]+"))


def test_sampling_params_round_trip():
    params = _full_params()
    assert all(getattr(params, f.name) != f.default for f in dataclasses.fields(params))
    msg = m.decode_to_engine(EngineClient.encode_request("r", [1, 2, 3], params))
    assert isinstance(msg, m.GenerateRequest) and msg.prompt_ids == [1, 2, 3]
    assert msg.params.to_params() == params
    # an int where a float belongs (JSON's "temperature": 1) is a float on the engine side
    msg = m.decode_to_engine(EngineClient.encode_request("r", [1], SamplingParams(temperature=1)))
    assert type(msg.params.temperature) is float and msg.params.to_params() == SamplingParams()


def _raw_request(**changes) -> bytes:
    """A GenerateRequest as the sender would make it, with some params replaced by raw values."""
    raw = msgspec.msgpack.decode(EngineClient.encode_request("bad", [1, 2], SamplingParams()))
    raw["params"].update(changes)
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize("changes, field, message", [
    (dict(top_k="5"), "top_k", "expected `int`, got `str`"),
    (dict(temperature=True), "temperature", "expected `float`, got `bool`"),
    (dict(stop=["a", 3]), "stop", "expected `str`, got `int`"),
    (dict(logit_bias={"x": 1.0}), "logit_bias", "expected `int`, got `str`"),
    (dict(grammar={"kind": "regex"}), "grammar", "missing required field `source`"),
    (dict(surprise=1), "params", "unknown field `surprise`"),
])
def test_typed_decode_names_the_field(changes, field, message):
    data = _raw_request(**changes)
    with pytest.raises(msgspec.ValidationError) as info:
        m.decode_to_engine(data)
    reply = m.undecodable_request(data, info.value)
    assert reply is not None and reply.request_id == "bad"
    assert reply.message.startswith(f"{field}: "), reply.message
    assert message in reply.message.lower(), reply.message


def test_an_undecodable_message_that_names_no_request_is_not_answered():
    data = msgspec.msgpack.encode({"type": "Ping", "nonce": "x"})
    with pytest.raises(msgspec.ValidationError) as info:
        m.decode_to_engine(data)
    assert m.undecodable_request(data, info.value) is None


@pytest.fixture(scope="module")
def engine(tiny_config_path):
    return make_tiny_engine(tiny_config_path, max_model_len=64)


@pytest.mark.parametrize("changes, field", [
    (dict(temperature=-1.0), "temperature"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=[100000]), "stop_token_ids"),
    (dict(grammar=m.WireGrammar("nonsense", "x")), "grammar"),
])
def test_a_value_that_fails_validation_answers_its_request(engine, changes, field):
    wire = msgspec.structs.replace(m.WireSamplingParams.from_params(SamplingParams()), **changes)
    reply = _handle(engine, m.GenerateRequest("r", [1, 2, 3], wire))
    assert isinstance(reply, m.RequestError) and reply.request_id == "r"
    assert reply.message.startswith(field), reply.message
    assert not engine.has_unfinished()


def test_the_loop_answers_a_mistyped_request_and_keeps_serving(engine):
    """The real ZMQ loop, on inproc sockets in a thread: a request that fails the typed decode gets
    a RequestError, the next one runs to its end, Shutdown ends the loop."""
    zctx = zmq.Context()
    to_engine, inbox = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    outbox, from_engine = zctx.socket(zmq.PUSH), zctx.socket(zmq.PULL)
    inbox.bind("inproc://in")
    to_engine.connect("inproc://in")
    from_engine.bind("inproc://out")
    outbox.connect("inproc://out")
    loop = threading.Thread(target=_loop, args=(engine, inbox, Outboxes([outbox]), os.getppid(), _Progress()))
    try:
        to_engine.send(_raw_request(top_k="5"))
        to_engine.send(EngineClient.encode_request("ok", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4)))
        loop.start()
        replies, tokens = [], []
        while not (tokens and tokens[-1].finished):
            assert from_engine.poll(30_000), "the engine loop stopped answering"
            msg = m.decode_from_engine(from_engine.recv())
            if isinstance(msg, m.RequestError):
                replies.append(msg)
            elif isinstance(msg, m.TokenOutputs):
                tokens.extend(msg.outputs)
        to_engine.send(m.encode(m.Shutdown()))
        loop.join(30)
        assert not loop.is_alive()
        assert [(r.request_id, r.message.split(":")[0]) for r in replies] == [("bad", "top_k")]
        assert sum(len(d.new_token_ids) for d in tokens) == 4 and tokens[-1].request_id == "ok"
    finally:
        for sock in (to_engine, inbox, outbox, from_engine):
            sock.close(linger=0)
        zctx.term()
