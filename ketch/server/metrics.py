"""Prometheus metrics for GET /metrics.

Two sources:
- the engine's state (queues, KV pages, token counters), fetched with a ping at scrape time and
  exported by a collector, so the numbers are the engine's own and never drift;
- the API process's view of each sample's timing (TTFT, inter-token latency, end to end),
  observed as outputs arrive, and the requests it finished or turned away.

Each server has its own registry (several apps can live in one test process). With several API
processes (`--api-server-count`) a scrape reaches one of them, so their own metrics (latencies,
finished and rejected requests, admitted sequences) are kept in prometheus_client's multiprocess
files in a directory they share and summed at scrape time (`shared_dir`); the engine's figures
and the engine's health are the same from every process.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ketch.engine.outputs import EngineStats
from ketch.engine.tpot_buckets import TPOT_BUCKETS

if TYPE_CHECKING:
    from ketch.server.client import EngineClient

# seconds; decode steps on a CPU take tens of ms, prefill of long prompts seconds
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, float("inf"))


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        gauges = {
            "ketch_num_requests_running": ("Sequences running in the engine (holding KV pages)", s.num_running),
            "ketch_num_requests_waiting": ("Sequences queued in the engine", s.num_waiting),
            "ketch_kv_pages_total": ("Pages in the KV pool", s.kv_pages_total),
            "ketch_kv_pages_used": ("KV pages held by running sequences", s.kv_pages_in_use),
            "ketch_kv_pages_cached": ("KV pages in the prefix cache", s.kv_pages_cached),
            "ketch_kv_pages_free": ("KV pages neither held nor cached", s.kv_pages_free),
            "ketch_kv_page_refs_unaccounted": (
                "References on KV pages that neither the prefix cache nor a running sequence explains "
                "(always 0; above 0 a reference leaked)", s.kv_page_refs_unaccounted),
            "ketch_prefix_cache_hit_rate": (
                "Share of admitted prompt tokens served from the prefix cache",
                s.cached_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "ketch_prompt_tokens": ("Prompt tokens of admitted sequences", s.prompt_tokens),
            "ketch_cached_prompt_tokens": ("Prompt tokens served from the prefix cache", s.cached_prompt_tokens),
            "ketch_generation_tokens": ("Tokens sampled", s.generated_tokens),
            "ketch_computed_tokens": ("Tokens run through the model (recomputation included)", s.computed_tokens),
            "ketch_preemptions": ("Sequences preempted for lack of KV pages", s.preemptions),
            "ketch_engine_steps": ("Engine steps run", s.steps),
            "ketch_kv_audits": ("Idle-time audits of the page accounting on every tier", s.audits),
            "ketch_kv_audit_failures": ("Audits that found the page accounting broken (always 0)", s.audit_failures),
            "ketch_engine_step_seconds": ("Wall time spent in engine steps (over ketch_engine_steps: the mean "
                                          "step)", s.step_seconds),
            "ketch_engine_decode_seconds": ("Finished requests' time from first to last output token in the engine "
                                            "(over ketch_engine_decode_intervals: the engine-side TPOT)",
                                            s.decode_seconds),
            "ketch_engine_decode_intervals": ("Token intervals of finished requests (output tokens - 1 each)",
                                              s.decode_intervals),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        if s.request_tpot_counts:
            yield _tpot_histogram(s)
        hits = CounterMetricFamily("ketch_cache_hit_tokens", "Prompt tokens served from the cache, by the tier that "
                                   "held them (device: the GPU/CPU pool; host: L2, loaded back)", labels=["tier"])
        hits.add_metric(["device"], s.device_hit_tokens)
        hits.add_metric(["host"], s.host_hit_tokens)
        if s.storage_enabled:
            hits.add_metric(["storage"], s.storage_hit_tokens)
        yield hits
        if s.storage_enabled:
            yield from _storage_metrics(s)
        if s.pd_enabled:
            yield from _pd_metrics(s)
        yield from _spec_metrics(s)
        if s.moe_layers:
            yield _moe_metrics(s)
        if s.kv_host_pages_total:  # the hierarchical cache is on
            yield GaugeMetricFamily("ketch_kv_host_pages_total", "Pages in the host tier (L2)", value=s.kv_host_pages_total)
            yield GaugeMetricFamily("ketch_kv_host_pages_free", "Host-tier pages holding nothing", value=s.kv_host_pages_free)
            host = {
                "ketch_hicache_loaded_bytes": ("KV bytes loaded from the host tier to the device", s.host_loaded_bytes),
                "ketch_hicache_saved_bytes": ("KV bytes copied from the device to the host tier", s.host_saved_bytes),
                "ketch_hicache_host_evicted_pages": ("Host-tier pages freed by LRU eviction", s.host_evicted_pages),
                "ketch_hicache_dropped_pages": ("Device pages evicted without a host copy (gone from both tiers)",
                                                s.host_dropped_pages),
                "ketch_hicache_load_seconds": ("Host time spent loading from the host tier (on the CPU the copies "
                                               "themselves, on CUDA only queueing them)", s.host_loaded_seconds),
                "ketch_hicache_load_copy_seconds": ("Time the host-to-device copies took where they ran (CUDA: "
                                                    "events on the copy stream; CPU: their wall time); loaded "
                                                    "bytes over it: the load bandwidth", s.host_load_copy_seconds),
                "ketch_hicache_save_seconds": ("Host time spent saving to the host tier (on the CPU the copies "
                                               "themselves, on CUDA only queueing them)", s.host_saved_seconds),
                "ketch_hicache_save_copy_seconds": ("Time the device-to-host copies took where they ran (CUDA: "
                                                    "events on the copy stream; CPU: their wall time); saved "
                                                    "bytes over it: the save bandwidth", s.host_save_copy_seconds),
            }
            for name, (doc, value) in host.items():
                yield CounterMetricFamily(name, doc, value=value)


def _moe_metrics(s: EngineStats) -> CounterMetricFamily:
    """Routed (token, pick)s per expert and sparse layer: the load EPLB balances (a hot expert is
    a series that grows faster than its layer's others)."""
    family = CounterMetricFamily("ketch_moe_expert_tokens", "Tokens routed to each expert of each MoE layer (a token "
                                 "counts once per expert it picks: top_k per token and layer; under CUDA graphs the "
                                 "padding rows of a decode graph count too)", labels=["layer", "expert"])
    for layer, counts in zip(s.moe_layers, s.moe_expert_tokens, strict=True):
        for expert, n in enumerate(counts):
            family.add_metric([str(layer), str(expert)], n)
    return family


def _pd_metrics(s: EngineStats) -> Iterator[Metric]:
    """PD transfers (engine/pd.py): live ones by state, ended ones by outcome."""
    live = GaugeMetricFamily("ketch_pd_transfers", "PD KV transfers in progress on this server, by state",
                             labels=["state"])
    for state, count in zip(("bootstrapping", "waiting_for_input", "transferring"), s.pd_live):
        live.add_metric([state], count)
    yield live
    ended = CounterMetricFamily("ketch_pd_transfers_ended", "PD KV transfers that ended, by outcome (failed: "
                                "timed out, aborted, refused, or the peer died)", labels=["outcome"])
    ended.add_metric(["succeeded"], s.pd_succeeded)
    ended.add_metric(["failed"], s.pd_failed)
    yield ended
    yield CounterMetricFamily("ketch_pd_pages_sent_early", "Prefill: KV pages handed to the transport while their "
                              "prompt's later chunks still ran (pipelined transfers)", value=s.pd_pages_sent_early)


def _spec_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding (engine/speculation.py), labelled by proposer; nothing when it is off."""
    if not s.spec_algorithm:
        return
    labels = ["proposer"]
    for name, doc, value in (
            ("ketch_spec_proposed_tokens", "Draft tokens verified", s.spec_proposed_tokens),
            ("ketch_spec_accepted_tokens", "Draft tokens the target kept", s.spec_accepted_tokens),
            ("ketch_spec_verifies", "Sequences verified with at least one draft token", s.spec_verifies),
            ("ketch_spec_plain_steps", "Decode steps the cost model ran without drafts", s.spec_plain_steps)):
        family = CounterMetricFamily(name, doc, labels=labels)
        family.add_metric([s.spec_algorithm], value)
        yield family
    # acceptance length = kept drafts + the target's own token, 1..k+1, as a histogram
    counts = s.spec_accept_counts
    buckets = [(str(a + 1), sum(counts[: a + 1])) for a in range(len(counts))] + [("+Inf", sum(counts))]
    total = sum((a + 1) * c for a, c in enumerate(counts))
    hist = HistogramMetricFamily("ketch_spec_accept_length", "Tokens a verified sequence yielded per step "
                                 "(kept drafts + 1)", labels=labels)
    hist.add_metric([s.spec_algorithm], buckets, total)
    yield hist


def _storage_metrics(s: EngineStats) -> Iterator[Metric]:
    """The L3 tier (cache/storage_tier.py): traffic, drops, rejected pages, prefetch waits."""
    counters = {
        "ketch_hicache_storage_read_bytes": ("KV bytes read from L3 (intact pages)", s.storage_read_bytes),
        "ketch_hicache_storage_written_bytes": ("KV bytes written to L3", s.storage_written_bytes),
        "ketch_hicache_storage_written_pages": ("KV pages written to L3", s.storage_written_pages),
        "ketch_hicache_storage_read_seconds": ("Time reading L3 pages (get + checks; read bytes over it: GB/s)",
                                               s.storage_read_seconds),
        "ketch_hicache_storage_write_seconds": ("Time writing L3 pages (encode + set)", s.storage_write_seconds),
        "ketch_hicache_storage_dropped_writes": ("L3 writes dropped (queue full, or the store refused)",
                                                 s.storage_dropped_writes),
        "ketch_hicache_storage_errors": ("Failed requests to the L3 store's server", s.storage_errors),
        "ketch_hicache_storage_read_errors": ("L3 reads that failed for another reason than a missing key",
                                              s.storage_read_errors),
        "ketch_hicache_storage_stale_temps_removed": ("File store temps of writers that died mid-write, swept",
                                                      s.storage_stale_temps_removed),
        "ketch_hicache_prefetches": ("Requests that waited at admission for L3 pages", s.storage_prefetches),
        "ketch_hicache_prefetch_timeouts": ("... and went in at the deadline with what had arrived",
                                            s.storage_prefetch_timeouts),
        "ketch_hicache_prefetch_wait_seconds": ("Time requests waited for L3 pages", s.storage_prefetch_wait_seconds),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    rejected = CounterMetricFamily("ketch_hicache_storage_rejected_pages", "L3 pages refused on load (dropped with "
                                   "the pages after them, recomputed): corrupt bytes, or another model's or format's",
                                   labels=["reason"])
    rejected.add_metric(["corrupt"], s.storage_rejected_corrupt)
    rejected.add_metric(["foreign"], s.storage_rejected_foreign)
    yield rejected


def _tpot_histogram(s: EngineStats) -> HistogramMetricFamily:
    cumulative = list(itertools.accumulate(s.request_tpot_counts))
    bounds = [repr(b) for b in TPOT_BUCKETS] + ["+Inf"]
    return HistogramMetricFamily(
        "ketch_engine_request_tpot_seconds",
        "Finished requests' time from first to last output token in the engine over their token intervals "
        "(the engine-side TPOT of each request; a client's median TPOT compares with this one's median)",
        buckets=list(zip(bounds, cumulative)), sum_value=s.request_tpot_sum)


class _HealthCollector(Collector):
    """The engine's health as this process sees it, computed at each scrape."""

    def __init__(self) -> None:
        self.client: "EngineClient | None" = None

    def collect(self) -> Iterator[Metric]:
        if self.client is None:
            return
        yield GaugeMetricFamily("ketch_engine_healthy", "1 while the engine is up and its watchdog is content",
                                value=1 if self.client.healthy() is None else 0)
        yield GaugeMetricFamily("ketch_engine_heartbeat_age_seconds", "Seconds since the engine process's last "
                                "heartbeat", value=self.client.watchdog.age(time.monotonic()))


class ServerMetrics:
    def __init__(self, shared_dir: str | None = None) -> None:
        """shared_dir: the multiprocess directory of a server with several API processes (every
        one of them passes the same; None: this process's metrics alone)."""
        self.registry = CollectorRegistry()
        self._engine, self._health = _EngineCollector(), _HealthCollector()
        self.registry.register(self._engine)
        self.registry.register(self._health)
        r: CollectorRegistry | None = self.registry
        if shared_dir is not None:
            # values written to per-process files in shared_dir; the scrape sums every process's
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = shared_dir  # where the value files go
            values.ValueClass = values.MultiProcessValue()
            MultiProcessCollector(self.registry, shared_dir)
            r = None  # the collector reads them back; registering them too would count this process twice
        self.ttft = Histogram("ketch_time_to_first_token_seconds", "Time from arrival to a sample's first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ketch_inter_token_latency_seconds", "Time between a sample's consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ketch_e2e_request_latency_seconds", "Time from arrival to a sample's last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("ketch_requests_finished", "Samples finished, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("ketch_requests_rejected", "Requests turned away, by reason", ["reason"], registry=r)
        self.admitted = Gauge("ketch_admitted_sequences",
                              "Sequences the API processes have admitted and not yet seen end (running or queued)",
                              registry=r, multiprocess_mode="livesum")

    def render(self, stats: EngineStats | None, client: "EngineClient | None" = None) -> bytes:
        """The exposition text; engine metrics are left out when the engine did not answer."""
        self._engine.stats = stats
        self._health.client = client
        return generate_latest(self.registry)
