"""`ketch bench serve`: the metric math (throughputs, latency percentiles, TPOT, ITL, the cache hit
rate) and the multi-turn per-round figures (TTFT, cache hit rate), on hand-made timings."""
from __future__ import annotations

import pytest

from ketch.bench.serve_metrics import RequestResult, compute_metrics, format_report


def test_metrics_on_hand_made_timings():
    a = RequestResult(success=True, prompt_len=100, output_len=10, ttft=0.1, latency=1.0, itl=[0.1] * 9)
    b = RequestResult(success=True, prompt_len=50, output_len=5, ttft=0.3, latency=2.0, itl=[0.2, 0.4, 0.5, 0.6])
    failed = RequestResult(success=False, prompt_len=70, error="HTTP 500")
    m = compute_metrics([a, b, failed], duration_s=4.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 150, 15)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.input_throughput == pytest.approx(37.5)
    assert m.output_throughput == pytest.approx(3.75)
    assert m.total_throughput == pytest.approx(41.25)
    assert m.concurrency == pytest.approx(0.75)  # (1 s + 2 s) of latency over 4 s
    assert m.mean_e2e_ms == pytest.approx(1500) and m.median_e2e_ms == pytest.approx(1500)
    assert m.p99_e2e_ms == pytest.approx(1000 + 0.99 * 1000)  # linear between the two ranks
    assert m.mean_ttft_ms == pytest.approx(200) and m.p99_ttft_ms == pytest.approx(100 + 0.99 * 200)
    # TPOT: a = 0.9 s / 9 = 100 ms, b = 1.7 s / 4 = 425 ms
    assert m.mean_tpot_ms == pytest.approx(262.5) and m.median_tpot_ms == pytest.approx(262.5)
    assert m.p99_tpot_ms == pytest.approx(100 + 0.99 * 325)
    # ITL pools the 13 gaps: nine 100s, then 200, 400, 500, 600
    assert m.mean_itl_ms == pytest.approx((900 + 1700) / 13)
    assert m.median_itl_ms == pytest.approx(100)
    assert m.max_itl_ms == pytest.approx(600)
    assert m.p95_itl_ms == pytest.approx(500 + 0.4 * 100)  # rank 0.95 * 12 = 11.4
    assert m.p99_itl_ms == pytest.approx(500 + 0.88 * 100)  # rank 11.88


def test_metrics_single_token_outputs_have_no_tpot_and_empty_runs_are_zero():
    one = RequestResult(success=True, prompt_len=3, output_len=1, ttft=0.2, latency=0.2)
    m = compute_metrics([one], duration_s=1.0)
    assert m.mean_tpot_ms == 0.0 and m.mean_itl_ms == 0.0 and m.mean_ttft_ms == pytest.approx(200)
    none = compute_metrics([RequestResult(error="x")], duration_s=1.0)
    assert none.completed == 0 and none.failed == 1 and none.concurrency == 0.0 and none.p99_e2e_ms == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([one], duration_s=0.0)


def test_cache_hit_rate_sums_cached_over_prompt_tokens_of_the_successes_that_said():
    def ok(prompt: int, cached: int | None) -> RequestResult:
        return RequestResult(success=True, prompt_len=prompt, output_len=2, ttft=0.1, latency=0.2, cached_tokens=cached)

    # a pooled ratio (1000 + 0 + 30) / (1100 + 1100 + 100), not the mean of per-request rates (0.40)
    failed = RequestResult(success=False, prompt_len=900, cached_tokens=800, error="HTTP 500")
    m = compute_metrics([ok(1100, 1000), ok(1100, 0), ok(100, 30), failed], duration_s=1.0)
    assert m.total_cached == 1030 and m.cache_hit_rate == pytest.approx(1030 / 2300)
    assert m.as_dict()["cache_hit_rate"] == pytest.approx(1030 / 2300)
    assert "Cache hit rate:                          44.78% (1030 prompt tokens cached)" in format_report(m, {})
    # a success whose server did not say is left out of both sums, not counted as a miss
    assert compute_metrics([ok(100, 50), ok(300, None)], 1.0).cache_hit_rate == pytest.approx(0.5)
    # no answer said: no rate (n/a), not a rate of 0
    silent = compute_metrics([ok(100, None)], 1.0)
    assert silent.cache_hit_rate is None and silent.total_cached is None
    assert "Cache hit rate:                          n/a" in format_report(silent, {})
    assert compute_metrics([ok(100, 0)], 1.0).cache_hit_rate == 0.0


def test_engine_side_tpot_median_from_two_histogram_readings():
    """The engine-side TPOT median of a run: the requests between two /metrics readings of a
    cumulative histogram, interpolated inside the bucket that holds the middle request."""
    from ketch.bench.serve_engine_steps import StepClock, step_window

    inf = float("inf")
    before = StepClock(10, 1.0, 0.0, 0.0, ((0.001, 5), (0.002, 5), (0.004, 5), (inf, 5)))
    # four requests in the run: one in (0, 1] ms, three in (2, 4] ms; the 2nd of 4 is the median
    after = StepClock(20, 2.0, 0.03, 10, ((0.001, 6), (0.002, 6), (0.004, 9), (inf, 9)))
    w = step_window(before, after)
    assert w.steps == 10 and w.mean_step_ms == pytest.approx(100) and w.decode_tpot_ms == pytest.approx(3)
    assert w.median_decode_tpot_ms == pytest.approx(2 + 2 * (2 - 1) / 3)  # one of the three, in ms
    # no request finished in the window, or the middle one above the last bound: no median
    assert step_window(before, StepClock(20, 2.0, 0.0, 0.0, before.tpot_buckets)).median_decode_tpot_ms is None
    above = StepClock(20, 2.0, 0.0, 0.0, ((0.001, 5), (0.002, 5), (0.004, 5), (inf, 8)))
    assert step_window(before, above).median_decode_tpot_ms is None


def test_multiturn_round_metrics_on_hand_made_timings():
    from ketch.bench.multiturn import round_metrics

    def ok(ttft: float, prompt: int, cached: int | None) -> RequestResult:
        return RequestResult(success=True, prompt_len=prompt, output_len=4, ttft=ttft, latency=1.0, cached_tokens=cached)

    # client-major, 3 clients x 3 rounds; client 2 failed its round 3
    results = [ok(0.30, 20, 0), ok(0.10, 50, 16), ok(0.12, 80, 48),
               ok(0.50, 20, 0), ok(0.20, 50, 32), ok(0.16, 80, 64),
               ok(0.40, 20, 0), ok(0.60, 50, 0), RequestResult(error="HTTP 500")]
    m = round_metrics(results, 3)
    r1, r2, r3 = m["per_round"]
    assert (r1["completed"], r1["failed"], r2["completed"], r2["failed"], r3["failed"]) == (3, 0, 3, 0, 1)
    assert r1["mean_ttft_ms"] == pytest.approx(400) and r1["median_ttft_ms"] == pytest.approx(400)
    assert (r1["prompt_tokens"], r1["cached_tokens"], r1["cache_hit_rate"]) == (60, 0, 0.0)
    assert (r2["prompt_tokens"], r2["cached_tokens"]) == (150, 48) and r2["cache_hit_rate"] == pytest.approx(0.32)
    assert r3["cache_hit_rate"] == pytest.approx(112 / 160)
    # pooled over the five successes of rounds 2 and 3 (236 ms), not a mean of the rounds' means (220 ms)
    assert m["mean_ttft_ms_rounds_2plus"] == pytest.approx(1000 * (0.10 + 0.12 + 0.20 + 0.16 + 0.60) / 5)
    assert m["cache_hit_rate_rounds_2plus"] == pytest.approx((48 + 112) / (150 + 160))
    # a server that does not say how many tokens were cached has no hit rate (not a rate of 0)
    silent = round_metrics([ok(0.1, 20, None), ok(0.1, 50, None)], 2)
    assert [r["cache_hit_rate"] for r in silent["per_round"]] == [None, None]
    assert silent["cache_hit_rate_rounds_2plus"] is None
    assert round_metrics([ok(0.1, 20, 0)], 1)["mean_ttft_ms_rounds_2plus"] is None  # one round: nothing after it


def test_pd_ttft_split_means_over_the_answers_that_carried_one():
    def ok(ttft_ms: float, timing: dict | None) -> RequestResult:
        return RequestResult(success=True, prompt_len=10, output_len=2, ttft=ttft_ms / 1e3, latency=1.0,
                             pd_timing=timing)

    t = {"prefill_ms": 40.0, "transfer_ms": 6.0, "kv_wait_ms": 50.0, "first_decode_ms": 2.0}
    results = [ok(60.0, t), ok(100.0, {**t, "prefill_ms": 80.0}),
               ok(500.0, None),  # a colocated answer: not in the split
               ok(70.0, {**t, "transfer_ms": None}),  # a part not measured: not in the split
               RequestResult(success=False, pd_timing=t)]  # failed: not in the split
    m = compute_metrics(results, duration_s=1.0)
    assert m.pd_split == {"prefill_ms": 60.0, "transfer_ms": 6.0, "first_decode_ms": 2.0,
                          "rest_ms": (60 - 48 + 100 - 88) / 2, "requests": 2}
    report = format_report(m, {})
    assert "Mean TTFT: KV transfer (ms):" in report and "TTFT split over (requests):" in report
    assert compute_metrics([ok(60.0, None)], duration_s=1.0).pd_split is None
    assert "KV transfer" not in format_report(compute_metrics([ok(60.0, None)], duration_s=1.0), {})
