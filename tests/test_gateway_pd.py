"""`ketch gateway --pd-disaggregation` in front of fake prefill and decode workers: real processes
on loopback (tests/pd_fake_worker.py) that log every body they get and how each request ended,
and fail when the request body tells them to. Driven by the openai SDK and raw HTTP.

What PD mode must do: the same body to a prefill and a decode worker, plus the bootstrap host and
port of that prefill worker and one room; the decode worker's answer to the client; a prefill
failure before the decode answer began answered instead, with the decode request closed; the
client leaving closes both.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import openai
import pytest
from gateway_util import request, running_gateway, stop, workers
from server_util import connect, free_port, health, parse_metrics, wait_for

from ketch.cli import main as cli_main

FAKE = str(Path(__file__).with_name("pd_fake_worker.py"))
PREFILL_PORTS = (9101, None)  # the second prefill worker's bootstrap port: the default, 8998


@dataclass
class Fake:
    proc: subprocess.Popen
    url: str

    def log(self) -> list[dict[str, Any]]:
        status, _, body = request(self.url, "GET", "/log")
        assert status == 200
        return json.loads(body)


@contextlib.contextmanager
def fakes(*roles: str) -> Iterator[list[Fake]]:
    started = []
    try:
        for i, role in enumerate(roles):
            port = free_port()
            proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--role", role, "--name", f"{role}{i}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append(Fake(proc, f"http://127.0.0.1:{port}"))
        for f in started:
            wait_for(lambda: f.proc.poll() is None and health(f.url) == 200, f"fake {f.url} to listen", 30)
        yield started
    finally:
        for f in started:
            stop(f.proc)


@dataclass
class PD:
    base: str
    prefills: list[Fake]
    decodes: list[Fake]

    def entries(self, tag: str) -> dict[str, tuple[Fake, dict[str, Any]]]:
        """The request tagged `tag`, as each role's worker got it: {role: (worker, log entry)}."""
        found = {}
        for role, pool in (("prefill", self.prefills), ("decode", self.decodes)):
            hits = [(f, e) for f in pool for e in f.log() if e["body"].get("user") == tag]
            assert len(hits) <= 1, hits
            if hits:
                found[role] = hits[0]
        return found

    def both(self, tag: str) -> dict[str, tuple[Fake, dict[str, Any]]]:
        wait_for(lambda: len(self.entries(tag)) == 2, f"both workers to get {tag}", 30)
        return self.entries(tag)

    def outcomes(self, tag: str) -> dict[str, str]:
        return {role: e["outcome"] for role, (_, e) in self.entries(tag).items()}


@pytest.fixture(scope="module")
def pd():
    with fakes("prefill", "prefill", "decode", "decode") as fs:
        prefill_args = []
        for f, port in zip(fs[:2], PREFILL_PORTS):
            prefill_args += ["--prefill", f.url] + ([str(port)] if port else [])
        decode_args = [a for f in fs[2:] for a in ("--decode", f.url)]
        with running_gateway("--pd-disaggregation", *prefill_args, *decode_args) as (_, base):
            yield PD(base, fs[:2], fs[2:])


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)


def bootstrap_port(pd: PD, prefill: Fake) -> int:
    return dict(zip((f.url for f in pd.prefills), (p or 8998 for p in PREFILL_PORTS)))[prefill.url]


def check_pair(pd: PD, tag: str, sent: dict[str, Any]) -> tuple[Fake, Fake]:
    """Both workers got `sent` plus the same bootstrap fields, naming the prefill worker that got it."""
    got = pd.both(tag)
    (prefill, p_entry), (decode, d_entry) = got["prefill"], got["decode"]
    assert p_entry["body"] == d_entry["body"]
    body = p_entry["body"]
    room = body["bootstrap_room"]
    assert type(room) is int and 0 <= room < 2**63
    assert body == {**sent, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port(pd, prefill),
                    "bootstrap_room": room}
    assert p_entry["path"] == d_entry["path"]
    return prefill, decode


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_whole_answers_come_from_the_decode_worker(pd: PD, route: str):
    tag = uuid.uuid4().hex
    if route == "chat":
        sent = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "user": tag}
        raw = sdk(pd.base).chat.completions.with_raw_response.create(**sent)
        text = raw.parse().choices[0].message.content
    else:
        sent = {"model": "m", "prompt": "Hello", "max_tokens": 4, "user": tag}
        raw = sdk(pd.base).completions.with_raw_response.create(**sent)
        text = raw.parse().choices[0].text
    prefill, decode = check_pair(pd, tag, sent)
    assert text == f"from {decode.proc.args[-1]}"
    assert raw.headers["x-ketch-worker"] == decode.url and raw.headers["x-ketch-prefill-worker"] == prefill.url
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "answered", "decode": "answered"}, "both answered", 30)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streams_come_from_the_decode_worker_untouched(pd: PD, route: str):
    tag = uuid.uuid4().hex
    if route == "chat":
        sent = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "user": tag}
        chunks = list(sdk(pd.base).chat.completions.create(**sent))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        sent = {"model": "m", "prompt": "Hello", "stream": True, "user": tag}
        text = "".join(c.choices[0].text for c in sdk(pd.base).completions.create(**sent))
    _, decode = check_pair(pd, tag, sent)  # no seed or return_token_ids added: no failover in PD mode
    assert text == f"from {decode.proc.args[-1]}"


def test_rooms_differ_and_both_pools_are_used(pd: PD):
    rooms, prefills, decodes = set(), set(), set()
    for i in range(8):
        tag = uuid.uuid4().hex
        # different texts: the cache-aware policy spreads them over the prefill workers' trees
        sdk(pd.base).completions.create(model="m", prompt=f"{i} " * 40, max_tokens=1, user=tag)
        got = pd.both(tag)
        rooms.add(got["prefill"][1]["body"]["bootstrap_room"])
        prefills.add(got["prefill"][0].url)
        decodes.add(got["decode"][0].url)
    assert len(rooms) == 8
    assert prefills == {f.url for f in pd.prefills} and decodes == {f.url for f in pd.decodes}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 500])
def test_a_prefill_error_is_the_answer_and_the_decode_request_is_closed(pd: PD, stream: bool, status: int):
    tag = uuid.uuid4().hex
    error = {"error": {"message": f"bad prompt {tag}", "type": "invalid_request_error", "param": None,
                       "code": "invalid_value"}}
    body = {"model": "m", "prompt": "Hello", "stream": stream, "user": tag,
            "fake": {"prefill": {"mode": "error", "status": status, "body": error},
                     "decode": {"mode": "hold", "events": 0}}}  # a decode server waits for the KV
    got_status, headers, got = request(pd.base, "POST", "/v1/completions", body)
    assert (got_status, json.loads(got)) == (status, error)
    assert headers["x-ketch-prefill-worker"] == headers["x-ketch-worker"]
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "errored", "decode": "closed_by_peer"}, "decode closed", 30)


def test_a_prefill_that_closes_the_connection_gives_503_and_the_decode_request_is_closed(pd: PD):
    tag = uuid.uuid4().hex
    body = {"model": "m", "prompt": "Hello", "user": tag,
            "fake": {"prefill": {"mode": "close"}, "decode": {"mode": "hold"}}}
    status, _, got = request(pd.base, "POST", "/v1/completions", body)
    assert status == 503 and "prefill worker" in json.loads(got)["error"]["message"]
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "closed_by_us", "decode": "closed_by_peer"}, "decode closed", 30)


def test_a_refused_prefill_connection_gives_503_and_the_decode_request_is_closed():
    dead = f"http://127.0.0.1:{free_port()}"
    with fakes("decode") as (decode,), \
         running_gateway("--pd-disaggregation", "--prefill", dead, "--decode", decode.url) as (_, base):
        tag = uuid.uuid4().hex
        status, _, got = request(base, "POST", "/v1/completions", {"model": "m", "prompt": "Hi", "user": tag,
                                                                    "fake": {"decode": {"mode": "hold"}}})
        error = json.loads(got)["error"]
        assert status == 503 and dead in error["message"] and error["code"] == "no_available_workers"
        wait_for(lambda: [e["outcome"] for e in decode.log() if e["body"]["user"] == tag] == ["closed_by_peer"],
                 "decode closed", 30)
        m = parse_metrics(request(base, "GET", "/metrics")[2].decode())
        assert m[f'ketch_gateway_worker_errors_total{{kind="connect",worker="{dead}"}}'] == 1


def test_a_client_that_leaves_closes_both_requests(pd: PD):
    tag = uuid.uuid4().hex
    body = {"model": "m", "prompt": "Hello", "stream": True, "user": tag,
            "fake": {"prefill": {"mode": "hold"}, "decode": {"mode": "hold", "events": 1}}}
    conn = connect(pd.base, 30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")  # the decode stream began
    assert pd.outcomes(tag) == {"prefill": "pending", "decode": "pending"}
    conn.close()
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "closed_by_peer", "decode": "closed_by_peer"}, "both closed", 30)


def test_a_client_that_leaves_before_any_answer_closes_both_requests(pd: PD):
    tag = uuid.uuid4().hex
    body = {"model": "m", "prompt": "Hello", "user": tag,
            "fake": {"prefill": {"mode": "hold"}, "decode": {"mode": "hold"}}}
    conn = connect(pd.base, 30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    pd.both(tag)
    conn.close()
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "closed_by_peer", "decode": "closed_by_peer"}, "both closed", 30)


def test_a_decode_stream_cut_ends_with_worker_lost_and_the_prefill_request_is_closed(pd: PD):
    tag = uuid.uuid4().hex
    body = {"model": "m", "prompt": "Hello", "stream": True, "user": tag,
            "fake": {"prefill": {"mode": "hold"}, "decode": {"mode": "cut", "events": 1}}}
    status, _, got = request(pd.base, "POST", "/v1/completions", body)
    events = [line for line in got.decode().split("\n\n") if line]
    assert status == 200 and len(events) == 3 and events[-1] == "data: [DONE]"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "worker_lost"
    wait_for(lambda: pd.outcomes(tag) == {"prefill": "closed_by_peer", "decode": "closed_by_us"}, "prefill closed", 30)


def test_models_workers_and_health(pd: PD):
    status, headers, got = request(pd.base, "GET", "/v1/models")
    assert status == 200 and json.loads(got)["data"][0]["id"].startswith("decode-")
    assert headers["x-ketch-worker"] in {f.url for f in pd.decodes}
    listed = workers(pd.base)
    assert {url: w["role"] for url, w in listed.items()} == {
        **{f.url: "prefill" for f in pd.prefills}, **{f.url: "decode" for f in pd.decodes}}
    assert [listed[f.url]["bootstrap_port"] for f in pd.prefills] == [9101, 8998]
    assert "bootstrap_port" not in listed[pd.decodes[0].url]
    status, _, got = request(pd.base, "GET", "/health")
    assert status == 200 and json.loads(got)["prefill_available"] == 2 and json.loads(got)["decode_available"] == 2


@pytest.mark.parametrize("args, message", [
    (["--pd-disaggregation", "--worker-urls", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3"],
     "--worker-urls and --pd-disaggregation are mutually exclusive"),
    (["--pd-disaggregation", "--prefill", "http://b:2"], "needs at least one --prefill URL [BOOTSTRAP_PORT] and one"),
    (["--pd-disaggregation", "--decode", "http://c:3"], "needs at least one --prefill URL [BOOTSTRAP_PORT] and one"),
    (["--prefill", "http://b:2", "--decode", "http://c:3"], "only with --pd-disaggregation"),
    (["--pd-disaggregation", "--prefill", "http://b:2", "x", "--decode", "http://c:3"], "must be a number, got 'x'"),
    (["--pd-disaggregation", "--prefill", "http://b:2", "70000", "--decode", "http://c:3"], "must be in [1, 65535]"),
    (["--pd-disaggregation", "--prefill", "http://b:2", "1", "2", "--decode", "http://c:3"],
     "takes a URL and optionally a bootstrap port"),
    (["--pd-disaggregation", "--prefill", "http://b:2", "--decode", "http://b:2"], "already registered"),
])
def test_cli_errors(args: list[str], message: str, capsys):
    assert cli_main(["gateway", "--port", "0", *args]) == 2
    assert message in capsys.readouterr().err


def test_workers_join_with_a_role_in_pd_mode(pd: PD):
    with fakes("prefill") as (new,):
        for body, param in [({"url": new.url}, "role"), ({"url": new.url, "role": "normal"}, "role"),
                            ({"url": new.url, "role": "decode", "bootstrap_port": 1}, "bootstrap_port"),
                            ({"url": new.url, "role": "prefill", "bootstrap_port": "1"}, "bootstrap_port")]:
            status, _, got = request(pd.base, "POST", "/workers", body)
            assert (status, json.loads(got)["error"]["param"]) == (400, param), got
        status, _, got = request(pd.base, "POST", "/workers", {"url": new.url, "role": "prefill", "bootstrap_port": 9300})
        assert status == 201 and (json.loads(got)["role"], json.loads(got)["bootstrap_port"]) == ("prefill", 9300)
        try:
            assert workers(pd.base)[new.url]["role"] == "prefill"
            status, _, got = request(pd.base, "GET", "/health")
            assert json.loads(got)["prefill_available"] == 3
        finally:
            status, _, _ = request(pd.base, "DELETE", f"/workers/{quote(new.url, safe='')}")
            assert status == 200


def test_the_bootstrap_fields_replace_a_clients_own():
    from ketch.gateway.config import BreakerConfig, HealthConfig
    from ketch.gateway.pd import with_bootstrap
    from ketch.gateway.worker import Worker
    from ketch.gateway.worker_url import parse_worker_url

    worker = Worker(parse_worker_url("http://[::1]:30001"), None, BreakerConfig(), HealthConfig(), "prefill", 8998)
    body = json.dumps({"prompt": "x", "bootstrap_room": 5, "bootstrap_host": "evil"}).encode()
    assert json.loads(with_bootstrap(body, worker, 7)) == {"prompt": "x", "bootstrap_room": 7, "bootstrap_host": "::1",
                                                           "bootstrap_port": 8998}


@pytest.mark.parametrize("sent_id", ["trace-7f3a:span/1", None, "has space"])
def test_both_workers_of_the_pair_get_the_clients_request_id(pd: PD, sent_id: str | None):
    """x-request-id (ketch/request_id.py): the client's usable one, else the gateway's own (a bad
    one is replaced, not refused), goes to the prefill and the decode worker alike and comes back
    on the answer, once."""
    tag = uuid.uuid4().hex
    headers = {} if sent_id is None else {"x-request-id": sent_id}
    status, got, _ = request(pd.base, "POST", "/v1/completions",
                             {"model": "m", "prompt": "Hi", "max_tokens": 2, "user": tag}, headers)
    assert status == 200
    rid = got["x-request-id"]
    if sent_id == "trace-7f3a:span/1":
        assert rid == sent_id
    else:
        assert len(rid) == 16 and int(rid, 16) >= 0
    seen = {role: entry["request_id"] for role, (_, entry) in pd.both(tag).items()}
    assert seen == {"prefill": rid, "decode": rid}


def prefill_tree_chars(pd: PD) -> dict[str, float]:
    m = parse_metrics(request(pd.base, "GET", "/metrics")[2].decode())
    return {f.url: m.get(f'ketch_gateway_worker_tree_chars{{worker="{f.url}"}}', 0) for f in pd.prefills}


@pytest.mark.parametrize("how", [{"mode": "error", "status": 400, "body": {"error": {"message": "too long"}}},
                                 {"mode": "close"}])
def test_a_prompt_the_prefill_worker_refused_leaves_its_tree(pd: PD, how: dict[str, Any]):
    """cache_aware picks the prefill worker (PD mode's default policy) and learns the prompt there;
    a prefill worker that refused it (a 4xx, or the connection closed unanswered) cached nothing,
    so the text leaves its tree again, as in the plain mode (forward.py). The same prompt
    answered stays learnt: the control that the tree grows at all."""
    tag = uuid.uuid4().hex
    prompt = f"{tag} " + "refused prefix " * 200
    before = prefill_tree_chars(pd)
    body = {"model": "m", "prompt": prompt, "user": tag, "fake": {"prefill": how, "decode": {"mode": "hold"}}}
    status, _, _ = request(pd.base, "POST", "/v1/completions", body)
    assert status == (400 if how["mode"] == "error" else 503)
    assert prefill_tree_chars(pd) == before
    answered = request(pd.base, "POST", "/v1/completions", {"model": "m", "prompt": prompt, "user": tag + "-ok"})
    assert answered[0] == 200
    # a tree shares prefixes: the text before may begin as the random tag does, never past it
    assert sum(prefill_tree_chars(pd).values()) >= sum(before.values()) + len(prompt) - len(tag)
