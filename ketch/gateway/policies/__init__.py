"""Routing policies behind one interface (base.py); `make_policy` picks one by its flag name."""
from __future__ import annotations

import random

from ketch.gateway.config import CacheAwareConfig
from ketch.gateway.policies.base import Choice, RoutingPolicy
from ketch.gateway.policies.cache_aware import CacheAware
from ketch.gateway.policies.least_load import LeastLoad
from ketch.gateway.policies.power_of_two import PowerOfTwo
from ketch.gateway.policies.round_robin import RoundRobin

__all__ = ["CacheAware", "Choice", "LeastLoad", "PowerOfTwo", "RoundRobin", "RoutingPolicy", "make_policy"]


def make_policy(name: str, cache_aware: CacheAwareConfig, rng: random.Random | None = None) -> RoutingPolicy:
    if name == "cache_aware":
        return CacheAware(cache_aware)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    raise ValueError(f"policy: unknown {name!r}")
