"""The server's own step clock, read from its /metrics around a benchmark run.

Median TPOT is what a client sees; the engine's mean step under the same load is what the GPU
(and the engine loop) needed. Their ratio says how much the API path adds per token: with
every request in every step, TPOT equals the mean step when nothing waits between the engine
and the client. Only a ketch server exports these counters; for another server this is None.
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


def read_step_clock(base_url: str, api_key: str | None, timeout: float = 10.0) -> StepClock | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base_url}/metrics", headers=headers),
                                    timeout=timeout) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None  # no /metrics (another server), or it did not answer: no step clock
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.value
    if "ketch_engine_steps_total" not in values:
        return None
    return StepClock(values["ketch_engine_steps_total"], values["ketch_engine_step_seconds_total"])


def mean_step_ms(before: StepClock | None, after: StepClock | None) -> tuple[int, float] | None:
    """(steps, mean step in ms) between two readings; None without both or without a step."""
    if before is None or after is None or after.steps <= before.steps:
        return None
    steps = after.steps - before.steps
    return int(steps), 1000 * (after.seconds - before.seconds) / steps
