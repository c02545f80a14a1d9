"""`ketch gateway`'s flags (SGLang router names where it has the knob) -> GatewayConfig."""
from __future__ import annotations

import argparse
import os

from ketch.gateway.config import (DEFAULT_BOOTSTRAP_PORT, POLICIES, BreakerConfig, CacheAwareConfig, GatewayConfig,
                                  HealthConfig, PrefillWorker, RetryConfig)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    d, ca, cb, rt, hc = GatewayConfig(), CacheAwareConfig(), BreakerConfig(), RetryConfig(), HealthConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--worker-urls", nargs="*", default=[], metavar="URL",
                   help="workers (`ketch serve`), e.g. http://127.0.0.1:30001; a worker's own API key as the "
                        "URL's password: http://:KEY@host:port. More can join with POST /workers")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="in PD mode: the policy over the prefill workers (decode workers: least load)")
    g = p.add_argument_group("PD disaggregation")
    g.add_argument("--pd-disaggregation", action="store_true",
                   help="send each request to a prefill and a decode worker at once (not with --worker-urls)")
    g.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                   help=f"a prefill worker and its KV bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}); repeat the flag "
                        "for more")
    g.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker; repeat for more")
    p.add_argument("--api-key", default=os.environ.get("KETCH_GATEWAY_API_KEY"),
                   help="require 'Authorization: Bearer <key>' at the gateway on every route but /health "
                        "(default: $KETCH_GATEWAY_API_KEY)")
    p.add_argument("--worker-api-key", default=os.environ.get("KETCH_WORKER_API_KEY"),
                   help="the key sent to workers whose URL carries none (default: $KETCH_WORKER_API_KEY)")
    g = p.add_argument_group("cache_aware")
    g.add_argument("--cache-threshold", type=float, default=ca.cache_threshold,
                   help="prefix match share of the request text that sends it to the matching worker")
    g.add_argument("--balance-abs-threshold", type=int, default=ca.balance_abs_threshold,
                   help="load imbalance (max - min) beyond which, with the relative one, the least loaded wins")
    g.add_argument("--balance-rel-threshold", type=float, default=ca.balance_rel_threshold)
    g.add_argument("--eviction-interval-secs", type=float, default=ca.eviction_interval_secs)
    g.add_argument("--max-tree-size", type=int, default=ca.max_tree_size, help="characters per worker's tree")
    g = p.add_argument_group("retries and circuit breaker")
    g.add_argument("--retry-max-retries", type=int, default=rt.max_retries, help="attempts in all, the first included")
    g.add_argument("--retry-initial-backoff-ms", type=float, default=rt.initial_backoff_ms)
    g.add_argument("--retry-max-backoff-ms", type=float, default=rt.max_backoff_ms)
    g.add_argument("--retry-backoff-multiplier", type=float, default=rt.backoff_multiplier)
    g.add_argument("--retry-jitter-factor", type=float, default=rt.jitter_factor)
    g.add_argument("--disable-retries", action="store_true")
    g.add_argument("--disable-failover", action="store_true",
                   help="a stream whose worker is lost ends with an error event instead of going on on another")
    g.add_argument("--cb-failure-threshold", type=int, default=cb.failure_threshold)
    g.add_argument("--cb-success-threshold", type=int, default=cb.success_threshold)
    g.add_argument("--cb-timeout-duration-secs", type=float, default=cb.timeout_duration_secs)
    g.add_argument("--disable-circuit-breaker", action="store_true")
    g = p.add_argument_group("health and load")
    g.add_argument("--health-check-interval-secs", type=float, default=hc.check_interval_secs)
    g.add_argument("--health-check-timeout-secs", type=float, default=hc.check_timeout_secs)
    g.add_argument("--health-failure-threshold", type=int, default=hc.failure_threshold)
    g.add_argument("--health-success-threshold", type=int, default=hc.success_threshold)
    g.add_argument("--load-interval-secs", type=float, default=d.load_interval_secs,
                   help="how often each worker's /metrics (running + waiting) is read")
    g.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs,
                   help="longest a worker may stay silent (before its answer, or between two stream chunks)")
    g.add_argument("--connect-timeout-secs", type=float, default=d.connect_timeout_secs)
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="larger bodies get a 413")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds open requests get to finish")


def prefill_worker(values: list[str]) -> PrefillWorker:
    """`--prefill URL [BOOTSTRAP_PORT]` -> PrefillWorker, or a ValueError saying what is wrong."""
    if len(values) > 2:
        raise ValueError(f"--prefill takes a URL and optionally a bootstrap port, got {' '.join(values)!r} "
                         "(repeat --prefill for each prefill worker)")
    if len(values) == 1:
        return PrefillWorker(values[0])
    try:
        port = int(values[1])
    except ValueError:
        raise ValueError(f"--prefill {values[0]}: the bootstrap port must be a number, got {values[1]!r}") from None
    return PrefillWorker(values[0], port)


def gateway_config(a: argparse.Namespace) -> GatewayConfig:
    """ValueError naming the field for a bad value."""
    return GatewayConfig(
        worker_urls=tuple(a.worker_urls), host=a.host, port=a.port, policy=a.policy, api_key=a.api_key,
        worker_api_key=a.worker_api_key,
        cache_aware=CacheAwareConfig(a.cache_threshold, a.balance_abs_threshold, a.balance_rel_threshold,
                                     a.eviction_interval_secs, a.max_tree_size),
        breaker=BreakerConfig(a.cb_failure_threshold, a.cb_success_threshold, a.cb_timeout_duration_secs,
                              enabled=not a.disable_circuit_breaker),
        retry=RetryConfig(a.retry_max_retries, a.retry_initial_backoff_ms, a.retry_max_backoff_ms,
                          a.retry_backoff_multiplier, a.retry_jitter_factor, enabled=not a.disable_retries),
        health=HealthConfig(a.health_check_interval_secs, a.health_check_timeout_secs, a.health_failure_threshold,
                            a.health_success_threshold),
        load_interval_secs=a.load_interval_secs, request_timeout_secs=a.request_timeout_secs,
        connect_timeout_secs=a.connect_timeout_secs, max_request_bytes=a.max_request_bytes,
        shutdown_timeout=a.shutdown_timeout, enable_failover=not a.disable_failover,
        pd_disaggregation=a.pd_disaggregation, prefill_workers=tuple(prefill_worker(v) for v in a.prefill),
        decode_urls=tuple(a.decode),
    )
