"""`ketch gateway`'s settings: frozen, checked once at start-up (a ValueError names the field).

Defaults follow SGLang's router where it has the same knob (PRIOR_ART.md, "Gateway"); the field
names are its flag names with dashes made underscores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

POLICIES = ("cache_aware", "round_robin", "least_load", "power_of_two")
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


def _positive(name: str, value: float) -> None:
    if not 0 < value < math.inf:
        raise ValueError(f"{name}: must be a positive number, got {value}")


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3  # a best prefix match at least this share of the text: go there
    balance_abs_threshold: int = 64  # imbalanced when max - min load > this ...
    balance_rel_threshold: float = 1.5  # ... and max > this × min: then the least loaded wins
    eviction_interval_secs: float = 120.0
    max_tree_size: int = 2**26  # characters per worker's tree, kept by the periodic eviction

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold: must be >= 0, got {self.balance_abs_threshold}")
        if not 1.0 <= self.balance_rel_threshold < math.inf:
            raise ValueError(f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}")
        _positive("eviction_interval_secs", self.eviction_interval_secs)
        if self.max_tree_size < 0:
            raise ValueError(f"max_tree_size: must be >= 0, got {self.max_tree_size}")


@dataclass(frozen=True)
class BreakerConfig:
    """Per worker: open after `failure_threshold` failures in a row, half-open (one probe request
    at a time) after `timeout_duration_secs`, closed after `success_threshold` good probes."""
    failure_threshold: int = 5
    success_threshold: int = 2
    timeout_duration_secs: float = 30.0
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("cb_failure_threshold / cb_success_threshold: must be >= 1, got "
                             f"{self.failure_threshold} / {self.success_threshold}")
        _positive("cb_timeout_duration_secs", self.timeout_duration_secs)


@dataclass(frozen=True)
class RetryConfig:
    """A request that reached no worker (refused, reset before an answer, 502/503) goes to another
    one after a backoff: initial × multiplier^k, capped, ± jitter. `max_retries` counts attempts in
    all, the first one included; each attempt goes to a worker not tried yet."""
    max_retries: int = 5
    initial_backoff_ms: float = 50.0
    max_backoff_ms: float = 5000.0
    backoff_multiplier: float = 2.0
    jitter_factor: float = 0.1
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.max_retries < 1:
            raise ValueError(f"retry_max_retries: must be >= 1, got {self.max_retries}")
        if not 0 <= self.initial_backoff_ms <= self.max_backoff_ms < math.inf:
            raise ValueError("retry_initial_backoff_ms / retry_max_backoff_ms: need 0 <= initial <= max, got "
                             f"{self.initial_backoff_ms} / {self.max_backoff_ms}")
        if not 1.0 <= self.backoff_multiplier < math.inf:
            raise ValueError(f"retry_backoff_multiplier: must be >= 1, got {self.backoff_multiplier}")
        if not 0.0 <= self.jitter_factor <= 1.0:
            raise ValueError(f"retry_jitter_factor: must be in [0, 1], got {self.jitter_factor}")

    @property
    def attempts(self) -> int:
        return self.max_retries if self.enabled else 1


@dataclass(frozen=True)
class HealthConfig:
    """GET /health on every worker each `check_interval_secs`; `failure_threshold` failures in a
    row mark it unhealthy (not routed to), `success_threshold` successes healthy again."""
    check_interval_secs: float = 30.0
    check_timeout_secs: float = 10.0
    failure_threshold: int = 3
    success_threshold: int = 2

    def __post_init__(self) -> None:
        _positive("health_check_interval_secs", self.check_interval_secs)
        _positive("health_check_timeout_secs", self.check_timeout_secs)
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("health_failure_threshold / health_success_threshold: must be >= 1, got "
                             f"{self.failure_threshold} / {self.success_threshold}")


@dataclass(frozen=True)
class PrefillWorker:
    """A prefill worker of PD mode: its URL and the port of its KV bootstrap server (on the URL's
    host), which the decode worker dials to fetch the prompt's KV."""
    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT

    def __post_init__(self) -> None:
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError(f"--prefill {self.url}: the bootstrap port must be in [1, 65535], got {self.bootstrap_port}")


@dataclass(frozen=True)
class GatewayConfig:
    worker_urls: tuple[str, ...] = ()  # may be empty: workers can join with POST /workers
    host: str = "127.0.0.1"
    port: int = 30000
    policy: str = "cache_aware"
    api_key: str | None = None  # the gateway's own front door
    worker_api_key: str | None = None  # sent to workers that have no key of their own
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    # workers' own queue lengths (/metrics: running + waiting) are scraped this often
    load_interval_secs: float = 1.0
    load_timeout_secs: float = 2.0
    request_timeout_secs: float = 1800.0  # longest silence from a worker (between two stream chunks)
    connect_timeout_secs: float = 5.0
    max_request_bytes: int = 32 * 1024 * 1024
    shutdown_timeout: float = 30.0  # SIGTERM: seconds open streams get to finish
    enable_failover: bool = True  # a stream whose worker is lost goes on on another (failover.py)
    # PD mode (pd.py): each request goes to a prefill and a decode worker at once
    pd_disaggregation: bool = False
    prefill_workers: tuple[PrefillWorker, ...] = ()
    decode_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        for name in ("load_interval_secs", "load_timeout_secs", "request_timeout_secs", "connect_timeout_secs"):
            _positive(name, getattr(self, name))
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes: must be >= 1, got {self.max_request_bytes}")
        if not 0 <= self.shutdown_timeout < math.inf:
            raise ValueError(f"shutdown_timeout: must be >= 0, got {self.shutdown_timeout}")
        self._check_pd()

    def _check_pd(self) -> None:
        if not self.pd_disaggregation:
            if self.prefill_workers or self.decode_urls:
                raise ValueError("--prefill / --decode: only with --pd-disaggregation")
            return
        if self.worker_urls:
            raise ValueError("--worker-urls and --pd-disaggregation are mutually exclusive: in PD mode name the "
                             "workers with --prefill URL [BOOTSTRAP_PORT] and --decode URL")
        if not self.prefill_workers or not self.decode_urls:
            raise ValueError("--pd-disaggregation: needs at least one --prefill URL [BOOTSTRAP_PORT] and one "
                             "--decode URL")

    @property
    def roles(self) -> tuple[str, ...]:
        """The kinds of worker a generation request needs one of each of."""
        return ("prefill", "decode") if self.pd_disaggregation else ("normal",)
