"""Metric math of `ketch bench serve`: per-request timings in, the bench_serving summary out.

Definitions (those of the usual serving benchmarks):
- TTFT: request sent → first non-empty content chunk.
- ITL: the gaps between consecutive content chunks, pooled over all requests (a chunk carrying
  several tokens is one gap).
- TPOT: (E2E − TTFT) / (output tokens − 1), per request with more than one output token.
- Concurrency: the sum of E2E latencies over the benchmark duration (the mean number in flight).
- Cache hit rate: prompt tokens the server's prefix cache served (its usage's
  `prompt_tokens_details.cached_tokens`) over prompt tokens, both summed over the successes whose
  answer said how many were cached; None when none did.
Token totals and throughputs count successful requests only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """One request's outcome; times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    generated_text: str = ""
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache served; None: it did not say
    pd_timing: dict[str, float | None] | None = None  # a PD decode server's TTFT split (usage.pd_timing, ms)


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input: int
    total_output: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_ms: float
    median_e2e_ms: float
    p99_e2e_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    total_cached: int | None = None  # prompt tokens served from the prefix cache (None: no answer said)
    cache_hit_rate: float | None = None
    # PD: the mean TTFT split over the answers whose usage carried one (None: none did)
    pd_split: dict[str, float] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _ms(values: list[float], stat: str, q: float = 50.0) -> float:
    """A statistic of `values` (seconds) in ms; 0.0 for no values, as the usual tools print."""
    if not values:
        return 0.0
    a = np.asarray(values, dtype=np.float64)
    if stat == "mean":
        v = a.mean()
    elif stat == "max":
        v = a.max()
    else:
        v = np.percentile(a, q)  # linear interpolation between closest ranks
    return float(v) * 1000.0


def cache_hits(results: list[RequestResult]) -> tuple[int, int, float | None]:
    """(prompt tokens, cached prompt tokens, their ratio) over the successes whose server reported
    cached tokens: a sum over requests, not a mean of per-request rates; the ratio is None when no
    success reported them (not a rate of 0) or their prompts were empty."""
    told = [r for r in results if r.success and r.cached_tokens is not None]
    prompt, cached = sum(r.prompt_len for r in told), sum(r.cached_tokens or 0 for r in told)
    return prompt, cached, (cached / prompt if told and prompt > 0 else None)


def compute_metrics(results: list[RequestResult], duration_s: float) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    e2e = [r.latency for r in ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    _, cached, hit_rate = cache_hits(ok)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input=total_in,
        total_output=total_out,
        request_throughput=len(ok) / duration_s,
        input_throughput=total_in / duration_s,
        output_throughput=total_out / duration_s,
        total_throughput=(total_in + total_out) / duration_s,
        concurrency=sum(e2e) / duration_s,
        mean_e2e_ms=_ms(e2e, "mean"),
        median_e2e_ms=_ms(e2e, "pct", 50),
        p99_e2e_ms=_ms(e2e, "pct", 99),
        mean_ttft_ms=_ms(ttft, "mean"),
        median_ttft_ms=_ms(ttft, "pct", 50),
        p99_ttft_ms=_ms(ttft, "pct", 99),
        mean_tpot_ms=_ms(tpot, "mean"),
        median_tpot_ms=_ms(tpot, "pct", 50),
        p99_tpot_ms=_ms(tpot, "pct", 99),
        mean_itl_ms=_ms(itl, "mean"),
        median_itl_ms=_ms(itl, "pct", 50),
        p95_itl_ms=_ms(itl, "pct", 95),
        p99_itl_ms=_ms(itl, "pct", 99),
        max_itl_ms=_ms(itl, "max"),
        total_cached=cached if hit_rate is not None else None,
        cache_hit_rate=hit_rate,
        pd_split=pd_split(ok),
    )


PD_PARTS = ("prefill_ms", "transfer_ms", "first_decode_ms")  # the sequential parts of a PD request's TTFT


def pd_split(ok: list[RequestResult]) -> dict[str, float] | None:
    """Mean TTFT split over the answers whose usage carried a complete `pd_timing` (a PD decode
    server's: ms on the prefill server, in the transfer, and from the KV's arrival to the first
    token), with `rest_ms` = the client's TTFT minus those three (gateway, HTTP, bootstrap, the
    decode server's wait for pages); `requests` says how many answers it is over."""
    rows = [(r.ttft * 1e3, r.pd_timing) for r in ok if r.pd_timing
            and all(isinstance(r.pd_timing.get(k), (int, float)) for k in PD_PARTS)]
    if not rows:
        return None
    out = {k: sum(t[k] for _, t in rows) / len(rows) for k in PD_PARTS}
    out["rest_ms"] = sum(ttft - sum(t[k] for k in PD_PARTS) for ttft, t in rows) / len(rows)
    out["requests"] = len(rows)
    return out


def report_row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label + ':':<40} {value}"


def report_rule(title: str = "", char: str = "-") -> str:
    return f" {title} ".center(50, char) if title else char * 50


def format_report(m: BenchmarkMetrics, header: dict[str, object]) -> str:
    """The summary block, one `label: value` per line, in bench_serving's layout and names."""
    lines = [report_rule("Serving Benchmark Result", "=")]
    lines += [report_row(k, v) for k, v in header.items()]
    lines += [
        report_row("Successful requests", m.completed),
        report_row("Failed requests", m.failed),
        report_row("Benchmark duration (s)", m.duration_s),
        report_row("Total input tokens", m.total_input),
        report_row("Total generated tokens", m.total_output),
        report_row("Request throughput (req/s)", m.request_throughput),
        report_row("Input token throughput (tok/s)", m.input_throughput),
        report_row("Output token throughput (tok/s)", m.output_throughput),
        report_row("Total token throughput (tok/s)", m.total_throughput),
        report_row("Concurrency", m.concurrency),
        report_row("Cache hit rate", "n/a (the server reported no cached tokens)" if m.cache_hit_rate is None
                   else f"{100 * m.cache_hit_rate:.2f}% ({m.total_cached} prompt tokens cached)"),
        report_rule("End-to-End Latency"),
        report_row("Mean E2E Latency (ms)", m.mean_e2e_ms),
        report_row("Median E2E Latency (ms)", m.median_e2e_ms),
        report_row("P99 E2E Latency (ms)", m.p99_e2e_ms),
        report_rule("Time to First Token"),
        report_row("Mean TTFT (ms)", m.mean_ttft_ms),
        report_row("Median TTFT (ms)", m.median_ttft_ms),
        report_row("P99 TTFT (ms)", m.p99_ttft_ms),
        *([] if m.pd_split is None else [
            report_row("Mean TTFT: prefill (ms)", m.pd_split["prefill_ms"]),
            report_row("Mean TTFT: KV transfer (ms)", m.pd_split["transfer_ms"]),
            report_row("Mean TTFT: first decode (ms)", m.pd_split["first_decode_ms"]),
            report_row("Mean TTFT: rest (ms)", m.pd_split["rest_ms"]),
            report_row("TTFT split over (requests)", m.pd_split["requests"]),
        ]),
        report_rule("Time per Output Token (excl. 1st token)"),
        report_row("Mean TPOT (ms)", m.mean_tpot_ms),
        report_row("Median TPOT (ms)", m.median_tpot_ms),
        report_row("P99 TPOT (ms)", m.p99_tpot_ms),
        report_rule("Inter-Token Latency"),
        report_row("Mean ITL (ms)", m.mean_itl_ms),
        report_row("Median ITL (ms)", m.median_itl_ms),
        report_row("P95 ITL (ms)", m.p95_itl_ms),
        report_row("P99 ITL (ms)", m.p99_itl_ms),
        report_row("Max ITL (ms)", m.max_itl_ms),
        report_rule(char="="),
    ]
    return "\n".join(lines)


def summarize_errors(results: list[RequestResult], limit: int = 5) -> list[str]:
    """The most frequent failure messages, `count × message`, most frequent first."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            counts[r.error or "unknown error"] = counts.get(r.error or "unknown error", 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [f"{n} × {msg}" for msg, n in ranked]
