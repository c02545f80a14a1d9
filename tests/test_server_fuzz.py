"""Fuzzing a real `ketch serve`: schemathesis against the schema the server itself serves, and a
hypothesis property over random bodies. Neither may ever get a 5xx, and afterwards every admission
slot and KV page is back. Bounded: fixed seeds, a fixed number of examples, and a server-side
deadline on every request (--request-timeout) so a fuzzed `max_tokens` cannot run for minutes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from xml.etree import ElementTree

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import connect, metrics, pages_all_back, running_server, wait_for

from ketch.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS

KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_schema_conformance,response_headers_conformance")


@pytest.fixture(scope="module")
def server():
    with running_server("--api-key", KEY, "--request-timeout", "1", "--max-n", "4") as running:
        yield running


def _settled(base: str) -> bool:
    m = metrics(base, AUTH)
    return pages_all_back(m) and m["ketch_admitted_sequences"] == 0


def test_schemathesis_finds_no_5xx_and_every_answer_fits_the_schema(server, tmp_path):
    _, base = server
    cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run", f"{base}/openapi.json",
           "--header", f"Authorization: Bearer {KEY}", "--checks", CHECKS, "--max-examples", "20",
           "--seed", "20261201", "--workers", "1", "--request-timeout", "30",
           "--phases", "examples,coverage,fuzzing", "--report", "junit", "--report-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,  # its cache stays there
                         env={**os.environ, "SCHEMATHESIS_TELEMETRY": "false", "NO_COLOR": "1"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    report = ElementTree.parse(next(tmp_path.glob("junit-*.xml"))).getroot()
    tested = {case.get("name") for case in report.iter("testcase")}
    assert {f"POST {route}" for route in ROUTES} <= tested, tested  # every POST route was fuzzed
    wait_for(lambda: _settled(base), "every slot and page back after the fuzzing")


# no subnormal floats: a library in the test process may run with flush-to-zero (hypothesis refuses then)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
                                           "content": st.text(max_size=30) | JSON}), max_size=3)
KNOWN = sorted(set(CHAT_FIELDS) | set(COMPLETION_FIELDS) | {"tokens", "add_special_tokens"})
# bodies that look like requests: known field names (some of them right for the route) with values
# of any JSON type, sometimes an unknown field; plus bodies that are not objects at all
BODIES = st.one_of(
    st.dictionaries(st.sampled_from(KNOWN) | st.text(max_size=10), JSON, max_size=6),
    st.fixed_dictionaries({"messages": MESSAGES}, optional={k: JSON for k in ("max_tokens", "n", "stream", "seed",
                                                                              "temperature", "stop", "timeout")}),
    st.fixed_dictionaries({"prompt": st.text(max_size=30) | JSON},
                          optional={k: JSON for k in ("max_tokens", "n", "stream", "logprobs", "echo", "top_k")}),
    JSON,
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=BODIES)
def test_random_bodies_never_get_a_5xx(server, route, body):
    _, base = server
    try:
        raw = json.dumps(body).encode()
    except ValueError:
        return  # not JSON-encodable from Python: nothing a client could send as JSON
    conn = connect(base)
    try:
        conn.request("POST", route, raw, {"content-type": "application/json", **AUTH})
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    assert resp.status < 500, (route, body, text[:500])
    if resp.status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}


def test_random_bodies_left_no_slot_and_no_page_behind(server):
    """Runs after the property above (file order): what it admitted has all come back."""
    _, base = server
    wait_for(lambda: _settled(base), "every slot and page back after the random bodies")
    assert metrics(base, AUTH)["ketch_prompt_tokens_total"] > 0  # some bodies did reach the engine
