"""A worker at capacity is not a failed worker: `ketch gateway` in front of two real `ketch serve`
replicas that hold one sequence each and queue none. A worker's 429 (queue_full, given before it
takes anything) sends the request on to the next worker, charges nothing to the busy one, and
only when every worker tried is busy does the client get a 429, with the workers' Retry-After.
"""
from __future__ import annotations

from gateway_util import replicas, running_gateway, workers
from server_util import metrics, open_stream, post, post_with_headers, wait_for

CMPL = "/v1/completions"
TEXT = "Once upon a time, in a harbour town where the fishing boats came in at dawn,"
LONG = {"prompt": TEXT, "max_tokens": 4000, "ignore_eos": True}


def test_a_busy_worker_passes_the_request_on_and_all_busy_is_a_429_with_retry_after():
    with replicas(2, "--max-running-requests", "1", "--max-queued-requests", "0") as rs, \
            running_gateway("--worker-urls", *(r.url for r in rs), "--policy", "cache_aware") as (_, base):
        first = open_stream(base, CMPL, LONG)  # one worker is full now
        # the same text: cache_aware picks the worker that has it, the full one; its 429 must
        # send the request to the other (open_stream asserts a 200 and reads the first event)
        second = open_stream(base, CMPL, LONG)
        m = metrics(base)
        busy_answers = {k: v for k, v in m.items() if k.startswith("ketch_gateway_responses_total") and '"429"' in k}
        assert sum(busy_answers.values()) == 1, busy_answers  # the first pick was the full worker
        assert m.get("ketch_gateway_retries_total") == 1
        per_worker = [metrics(r.url)["ketch_num_requests_running"] for r in rs]
        assert per_worker == [1, 1], per_worker  # one stream on each

        # both full: the gateway's own 429 after trying both, with when to come back
        status, headers, body = post_with_headers(base, CMPL, {"prompt": TEXT, "max_tokens": 2})
        assert status == 429, body
        assert body["error"]["code"] == "queue_full" and body["error"]["type"] == "rate_limit_error"
        assert all(r.url in body["error"]["message"] for r in rs), body  # both were tried
        assert int(headers["retry-after"]) >= 1

        # busy is not broken: no failure charged, both workers still taken
        m = metrics(base)
        assert not any(k.startswith("ketch_gateway_worker_errors_total") and v for k, v in m.items()), m
        assert m.get("ketch_gateway_no_available_worker_total", 0) == 0
        states = workers(base)
        assert len(states) == 2 and all(w["breaker"] == "closed" and w["available"] for w in states.values()), states

        # a slot frees: the next request is served
        first[0].close()
        wait_for(lambda: sum(metrics(r.url)["ketch_num_requests_running"] for r in rs) == 1, "the dropped stream's slot")
        status, body = post(base, CMPL, {"prompt": TEXT, "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        second[0].close()
