"""The gateway's own /metrics (Prometheus): what it sent where, what failed, how it routed.

Events are counters updated as they happen; the workers' state (in flight, load, health,
breaker, tree size) is read at scrape time by a collector, so a worker that left is gone from
the next scrape instead of lingering as a stale gauge. Each gateway has its own registry.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ketch.gateway.policies import Choice, RoutingPolicy
from ketch.gateway.registry import WorkerRegistry

_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _WorkerCollector(Collector):
    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy, clock: Callable[[], float]) -> None:
        self.registry, self.policy, self.clock = registry, policy, clock

    def collect(self) -> Iterator[Metric]:
        now, workers, trees = self.clock(), self.registry.all(), self.policy.tree_sizes()
        families = {
            "in_flight": GaugeMetricFamily("ketch_gateway_worker_in_flight",
                                           "Requests this gateway has open at the worker", labels=["worker"]),
            "load": GaugeMetricFamily("ketch_gateway_worker_load", "In flight + the worker's own running and waiting "
                                      "sequences beyond them (last scrape)", labels=["worker"]),
            "healthy": GaugeMetricFamily("ketch_gateway_worker_healthy", "1: passing health checks", labels=["worker"]),
            "available": GaugeMetricFamily("ketch_gateway_worker_available",
                                           "1: a request may go there now (healthy, breaker lets it)", labels=["worker"]),
            "breaker": GaugeMetricFamily("ketch_gateway_worker_breaker_state", "0 closed, 1 open, 2 half-open",
                                         labels=["worker"]),
            "tree": GaugeMetricFamily("ketch_gateway_worker_tree_chars",
                                      "Characters in the worker's cache-aware radix tree", labels=["worker"]),
        }
        opened = CounterMetricFamily("ketch_gateway_worker_breaker_opens", "Times the worker's breaker opened",
                                     labels=["worker"])
        for w in workers:
            families["in_flight"].add_metric([w.url], w.in_flight)
            families["load"].add_metric([w.url], w.load)
            families["healthy"].add_metric([w.url], int(w.health.healthy))
            families["available"].add_metric([w.url], int(w.available(now)))
            families["breaker"].add_metric([w.url], int(w.breaker.state(now)))
            families["tree"].add_metric([w.url], trees.get(w.url, 0))
            opened.add_metric([w.url], w.breaker.times_opened)
        yield GaugeMetricFamily("ketch_gateway_workers", "Workers registered", value=len(workers))
        yield from families.values()
        yield opened


class GatewayMetrics:
    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy, clock: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ketch_gateway_requests", "Requests sent to a worker (each attempt once)",
                                ["worker", "route"], registry=r)
        self.responses = Counter("ketch_gateway_responses", "Answers from workers by status", ["worker", "status"],
                                 registry=r)
        self.worker_errors = Counter("ketch_gateway_worker_errors", "Failures charged to a worker: connect, reset "
                                     "(lost before an answer), timeout, status_5xx, stream_cut", ["worker", "kind"],
                                     registry=r)
        self.failovers = Counter("ketch_gateway_failovers", "Streams whose worker was lost mid-stream, by outcome: "
                                 "resumed on another worker, gave_up, not_resumable (n > 1, several prompts)",
                                 ["outcome"], registry=r)
        self.failover_diverged = Counter("ketch_gateway_failover_diverged", "Continuations dropped: the worker made "
                                         "the stream's last tokens otherwise (resume_diverged); the stream went "
                                         "on on another worker or gave up", registry=r)
        self.failover_tokens = Counter("ketch_gateway_failover_tokens", "Tokens a failed-over stream's client already "
                                       "had, which the next worker went on from", registry=r)
        self.retries = Counter("ketch_gateway_retries", "Attempts beyond a request's first", registry=r)
        self.no_worker = Counter("ketch_gateway_no_available_worker", "Requests answered 503: no worker could take "
                                 "them", registry=r)
        self.decisions = Counter("ketch_gateway_routing_decisions", "Routing choices by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.match_ratio = Histogram("ketch_gateway_cache_match_ratio", "cache_aware: best prefix match / text length "
                                     "at each decision made on the cache", buckets=_RATIO_BUCKETS, registry=r)
        r.register(_WorkerCollector(registry, policy, clock))

    def routed(self, policy: str, choice: Choice) -> None:
        self.decisions.labels(policy, choice.reason).inc()
        if choice.match_ratio is not None:
            self.match_ratio.observe(choice.match_ratio)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
