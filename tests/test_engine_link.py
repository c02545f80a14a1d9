"""The API process's ZMQ link to the engine (server/client.py): a request sent before the engine's
inbox is listening is queued and delivered, never refused (a 500 under load in CI, 2026-12-04: the
API process bound its PUSH socket and had no pipe until the engine's connect landed)."""
from __future__ import annotations

import asyncio

import zmq

from ketch.config import EngineConfig
from ketch.engine import messages as m
from ketch.sampling.params import SamplingParams
from ketch.server.client import EngineClient


def test_a_request_sent_before_the_engine_listens_arrives_once_it_does(tmp_path):
    client = EngineClient(EngineConfig(), (), workdir=str(tmp_path))
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    try:
        client._link()
        client.alive = True  # what start() sets on EngineReady: the window this guards is right after it
        message = client.encode_request("r1", [1, 2, 3], SamplingParams(max_tokens=2))
        client.add("r1", message, asyncio.Queue())  # no engine socket exists yet
        input_addr, _ = EngineClient.addresses(str(tmp_path), 0)
        inbox.bind(input_addr)  # the engine, late: what run_engine does with its inbox
        assert inbox.poll(10_000), "the queued request never arrived"
        got = m.decode_to_engine(inbox.recv())
        assert isinstance(got, m.GenerateRequest) and got.request_id == "r1" and got.prompt_ids == [1, 2, 3]
    finally:
        inbox.close(linger=0)
        ctx.term()
        client.close()
