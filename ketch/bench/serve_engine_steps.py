"""The server's own step clock, read from its /metrics around a benchmark run.

Median TPOT is what a client sees; the engine's mean step under the same load is what the GPU
(and the engine loop) needed. The mean step counts every step, prompt-heavy ones included, which
a request spends before its first token (in its TTFT, not its TPOT); the engine's decode clock
is the like-for-like yardstick: finished requests' time from first to last token *in the engine*
over their token intervals, the engine-side TPOT. Client TPOT over it says how much the API path
adds per token (1.0: nothing). Only a ketch server exports these counters; otherwise None.
"""
from __future__ import annotations

from dataclasses import dataclass

import urllib.error
import urllib.request
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class StepClock:
    steps: float
    seconds: float
    decode_seconds: float = 0.0
    decode_intervals: float = 0.0
    tpot_buckets: tuple[tuple[float, float], ...] = ()  # (upper bound s, cumulative count), +Inf last
    spec: tuple[float, float, float] = (0.0, 0.0, 0.0)  # speculative decoding: proposed, accepted, verifies


def read_step_clock(base_url: str, api_key: str | None, timeout: float = 10.0) -> StepClock | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/metrics", headers=headers),
                                    timeout=timeout) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None  # no /metrics (another server), or it did not answer: no step clock
    values: dict[str, float] = {}
    buckets: list[tuple[float, float]] = []
    spec = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ketch_engine_request_tpot_seconds_bucket":
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name in spec:  # one series per proposer: summed
                spec[sample.name] += sample.value
            else:
                values[sample.name] = sample.value
    if "ketch_engine_steps_total" not in values:
        return None
    return StepClock(values["ketch_engine_steps_total"], values["ketch_engine_step_seconds_total"],
                     values.get("ketch_engine_decode_seconds_total", 0.0),
                     values.get("ketch_engine_decode_intervals_total", 0.0), tuple(sorted(buckets)),
                     tuple(spec[name] for name in SPEC_COUNTERS))


SPEC_COUNTERS = ("ketch_spec_proposed_tokens_total", "ketch_spec_accepted_tokens_total", "ketch_spec_verifies_total")


@dataclass(frozen=True)
class StepWindow:
    """The engine's clocks between two readings."""
    steps: int
    mean_step_ms: float
    decode_tpot_ms: float | None  # None: no request with two or more tokens finished in the window
    median_decode_tpot_ms: float | None = None  # the per-request distribution's median (interpolated)
    # speculative decoding (None: no verify in the window): tokens per verified sequence and step
    # (kept drafts + 1), and the share of draft tokens kept
    spec_accept_length: float | None = None
    spec_acceptance_rate: float | None = None


def step_window(before: StepClock | None, after: StepClock | None) -> StepWindow | None:
    """None without both readings or without a step between them."""
    if before is None or after is None or after.steps <= before.steps:
        return None
    steps = after.steps - before.steps
    intervals = after.decode_intervals - before.decode_intervals
    tpot = 1000 * (after.decode_seconds - before.decode_seconds) / intervals if intervals > 0 else None
    proposed, accepted, verifies = (a - b for a, b in zip(after.spec, before.spec))
    return StepWindow(int(steps), 1000 * (after.seconds - before.seconds) / steps, tpot,
                      _median_ms(before.tpot_buckets, after.tpot_buckets),
                      1 + accepted / verifies if verifies > 0 else None, accepted / proposed if proposed > 0 else None)


def _median_ms(before: tuple[tuple[float, float], ...], after: tuple[tuple[float, float], ...]) -> float | None:
    """The median of the requests counted between two readings of a cumulative histogram,
    interpolated linearly inside its bucket (None: no request, or the median is past the last bound)."""
    if not after or (before and [b for b, _ in before] != [b for b, _ in after]):
        return None
    old = dict(before)
    counts = [(bound, n - old.get(bound, 0.0)) for bound, n in after]
    total = counts[-1][1]
    if total <= 0:
        return None
    lower, below = 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= total / 2:
            if bound == float("inf"):
                return None
            inside = cumulative - below
            return 1000 * (lower + (bound - lower) * (total / 2 - below) / inside)
        lower, below = bound, cumulative
    return None
