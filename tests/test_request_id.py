"""x-request-id (ketch/request_id.py): a client's usable id is kept, anything else replaced by a
new one; the answer carries exactly one. `ketch gateway` passes the id on to the worker it
forwards to (tests/test_gateway_pd.py: to both workers of a PD pair), so the client, the gateway
and the worker name one request alike; `ketch serve` echoes it (test_server_errors.py)."""
from __future__ import annotations

import asyncio
import uuid

import pytest
from gateway_util import request, running_gateway
from test_gateway_pd import fakes

from ketch.request_id import HEADER, MAX_LEN, SendWithId, request_id


@pytest.mark.parametrize("value", [b"abc", b"trace-7f3a:span/1", b"x" * MAX_LEN, b"~!#$%&'*+.^_`|"])
def test_a_usable_client_id_is_kept(value: bytes):
    assert request_id([(b"accept", b"*/*"), (HEADER, value)]) == value.decode()


@pytest.mark.parametrize("value", [b"", b"x" * (MAX_LEN + 1), b"has space", b"tab\there", b"nul\x00", b"caf\xc3\xa9"])
def test_anything_else_gets_a_new_id(value: bytes):
    got = request_id([(HEADER, value)])
    assert len(got) == 16 and int(got, 16) >= 0 and got != request_id([(HEADER, value)])


def test_no_header_gets_a_new_id_each_time():
    ids = {request_id([]) for _ in range(50)}
    assert len(ids) == 50


def test_the_answer_carries_one_id_and_the_extra_headers():
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    wrapped = SendWithId(send, "mine", ((b"x-extra", b"1"),))
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json"), (b"X-Request-Id", b"relayed")]}
    asyncio.run(wrapped(start))
    asyncio.run(wrapped({"type": "http.response.body", "body": b"{}"}))
    assert sent[0]["headers"] == [(b"content-type", b"application/json"), (HEADER, b"mine"), (b"x-extra", b"1")]
    assert sent[1] == {"type": "http.response.body", "body": b"{}"}


def test_the_wrapper_keeps_the_bound_senders_cycle():
    """The gateway's relay writes a stream on uvicorn's transport when `send.__self__` is
    uvicorn's response cycle (gateway/client_stream.py): wrapped, it still is (without this the
    relay fell back to its queued path, and the gateway's serving test timed out)."""
    class Cycle:
        async def send(self, message: dict) -> None:
            pass

    cycle = Cycle()
    assert SendWithId(cycle.send, "r").__self__ is cycle


def test_the_gateway_passes_the_id_to_its_worker_and_answers_with_it():
    """A gateway in front of a (fake) worker: with the client's id, without one, and on the
    gateway's own 401 (no key sent) and 404 answers."""
    with fakes("decode") as (worker,), \
            running_gateway("--worker-urls", worker.url, "--api-key", "k") as (_, base):
        auth = {"authorization": "Bearer k"}
        for sent in ("client-42", None):
            tag = uuid.uuid4().hex
            headers = {**auth, **({} if sent is None else {"x-request-id": sent})}
            status, got, _ = request(base, "POST", "/v1/completions",
                                     {"model": "m", "prompt": "Hi", "max_tokens": 2, "user": tag}, headers)
            assert status == 200
            rid = got["x-request-id"]
            assert rid == sent if sent else len(rid) == 16
            entries = [e for e in worker.log() if e["body"].get("user") == tag]
            assert [e["request_id"] for e in entries] == [rid]
        for path, key, want in (("/v1/completions", {}, 401), ("/nowhere", auth, 404)):
            status, got, _ = request(base, "POST", path, {"prompt": "x"}, {**key, "x-request-id": "own-1"})
            assert status == want and got["x-request-id"] == "own-1"
