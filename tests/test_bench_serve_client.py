"""`ketch bench serve`'s client: SSE framing under any cut of the stream, and splitting the load over
client processes and merging their records back."""
from __future__ import annotations

import asyncio

import pytest

from ketch.bench.serve_http import _Exchange
from ketch.bench.serve_load import Load, LoadRun
from ketch.bench.serve_metrics import RequestResult
from ketch.bench.serve_procs import merge, split
from ketch.cli import main


def _payloads(stream: bytes, cuts: list[int]) -> list[bytes]:
    """The `data:` payloads the client's framing hands on when `stream` arrives cut at `cuts`."""
    got: list[bytes] = []
    ex = _Exchange(lambda payload, now: got.append(payload) and False, asyncio.Future(loop=asyncio.new_event_loop()))
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        ex.feed_events(stream[a:b], 0.0)
    if ex.tail:
        ex.feed_events(b"\n", 0.0)  # what the end of the body does with a last unterminated line
    return got


def test_sse_lines_survive_any_cut_and_any_line_end():
    stream = (b'data: {"a": 1}\n\n: a comment\r\n\r\ndata:{"b": 2}\r\n\r\nevent: x\rdata: {"c": 3}\r\r'
              b'data: [DONE]')
    want = [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b"[DONE]"]
    assert _payloads(stream, []) == want
    for cut in range(1, len(stream)):  # one cut anywhere, a CRLF split across reads included
        assert _payloads(stream, [cut]) == want, cut
    assert _payloads(stream, list(range(1, len(stream)))) == want  # a byte per read


def test_split_divides_requests_concurrency_and_rate():
    shares = split(10, Load(max_concurrency=5, request_rate=4.0, seed=7), 2)
    assert [idx for idx, _ in shares] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert [s for _, s in shares] == [Load(3, 2.0, 7), Load(2, 2.0, 8)]
    assert [s.max_concurrency for _, s in split(4, Load(None, float("inf"), 0), 3)] == [None] * 3
    with pytest.raises(ValueError, match="max_concurrency"):
        split(10, Load(1, 1.0, 0), 2)
    with pytest.raises(ValueError, match="more than the 1 requests"):
        split(1, Load(None, 1.0, 0), 2)


def test_merge_puts_records_back_in_request_order_over_the_union_window():
    def rec(i: int) -> RequestResult:
        return RequestResult(success=True, prompt_len=i, output_len=2, ttft=0.1, latency=0.5, itl=[0.4])

    first = LoadRun([rec(0), rec(2), rec(4)], start=10.0, end=13.0, cpu_s=1.5)
    second = LoadRun([rec(1), rec(3)], start=10.5, end=14.0, cpu_s=1.0)
    results, duration, cpu = merge([[0, 2, 4], [1, 3]], [first, second])
    assert [r.prompt_len for r in results] == [0, 1, 2, 3, 4]
    assert duration == pytest.approx(4.0)  # 10.0 (first start) to 14.0 (last end), not either window
    assert cpu == [(1.5, 3.0), (1.0, 3.5)]
    with pytest.raises(ValueError, match="cover"):
        merge([[0, 2, 4], [1, 1]], [first, second])


def test_cli_rejects_more_client_processes_than_concurrency(capsys):
    assert main(["bench", "serve", "--num-client-processes", "3", "--max-concurrency", "2"]) == 2
    assert "num_client_processes" in capsys.readouterr().err
