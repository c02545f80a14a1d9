"""Routing policies' decisions without servers: real Worker objects whose load is set by hand."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from ketch.gateway.config import BreakerConfig, CacheAwareConfig, HealthConfig
from ketch.gateway.policies import CacheAware, LeastLoad, PowerOfTwo, RoundRobin, make_policy
from ketch.gateway.routed import COMPLETIONS, RoutedRequest
from ketch.gateway.worker import Worker
from ketch.gateway.worker_url import WorkerAddress

SYSTEM_A = "You are a pirate. Answer every question in pirate speech, briefly, and never break character.\n"
SYSTEM_B = "You are a librarian. Recommend exactly one book per answer and say why in one sentence.\n"


def make_workers(n: int, loads: list[int] | None = None) -> list[Worker]:
    workers = [Worker(WorkerAddress(f"http://w{i}:1", None), None, BreakerConfig(), HealthConfig()) for i in range(n)]
    for w, load in zip(workers, loads or [0] * n):
        w.in_flight = load
    return workers


def req(text: str) -> RoutedRequest:
    return RoutedRequest(COMPLETIONS, text, False, b"{}")


def test_cache_aware_keeps_a_prefix_group_on_one_worker_and_spreads_groups():
    policy, workers = CacheAware(CacheAwareConfig()), make_workers(2)
    picks = {}
    for i in range(4):
        for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
            choice = policy.pick(req(system + f"question {i}"), workers)
            picks.setdefault(name, []).append(choice.worker.url)
            assert choice.reason == ("smallest_tree" if i == 0 else "cache_hit")
    assert len(set(picks["a"])) == 1 and len(set(picks["b"])) == 1  # each group stays put
    assert picks["a"][0] != picks["b"][0]  # the second group went to the emptier tree


@pytest.mark.parametrize("shared, reason", [(29, "smallest_tree"), (30, "cache_hit"), (31, "cache_hit")])
def test_cache_threshold_is_inclusive(shared: int, reason: str):
    policy, workers = CacheAware(CacheAwareConfig(cache_threshold=0.3)), make_workers(2)
    policy.pick(req("x" * 100), workers)  # worker 0 (tie on everything: the first)
    policy.pick(req("z" * 10), workers)  # worker 1 (smallest tree): trees 100 vs 10 characters
    choice = policy.pick(req("x" * shared + "y" * (100 - shared)), workers)
    assert choice.reason == reason and choice.match_ratio == pytest.approx(shared / 100)
    # the smallest tree is worker 1's; a hit stays with worker 0
    assert choice.worker is (workers[0] if reason == "cache_hit" else workers[1])


@pytest.mark.parametrize("loads, imbalanced", [
    ([100, 10], True),     # 90 > 64 and 100 > 15
    ([74, 10], False),     # 64 is not > 64
    ([75, 10], True),
    ([300, 230], False),   # 70 > 64 but 300 < 1.5 × 230
    ([300, 199], True),
    ([65, 0], True),       # anything > 1.5 × 0
])
def test_imbalance_needs_both_thresholds(loads: list[int], imbalanced: bool):
    policy, workers = CacheAware(CacheAwareConfig(balance_abs_threshold=64, balance_rel_threshold=1.5)), make_workers(2)
    policy.pick(req(SYSTEM_A + "q0"), workers)  # the prefix goes to worker 0
    workers[0].in_flight, workers[1].in_flight = loads
    choice = policy.pick(req(SYSTEM_A + "q1"), workers)
    if imbalanced:
        assert choice.reason == "balance" and choice.worker is workers[1]  # the least loaded, match or not
    else:
        assert choice.reason == "cache_hit" and choice.worker is workers[0]


def test_load_counts_scraped_sequences_beyond_the_gateways_own():
    w = make_workers(1)[0]
    w.in_flight = 3
    w.set_scraped(10)  # the worker runs 10: 3 of them are ours, 7 came from elsewhere
    assert w.external == 7 and w.load == 10
    w.in_flight = 5  # two more sent since the scrape
    assert w.load == 12
    w.set_scraped(2)  # fewer than ours in flight (the scrape lags): nothing external, never negative
    assert w.external == 0 and w.load == 5


def test_no_match_anywhere_goes_to_the_smallest_tree_even_at_threshold_zero():
    policy, workers = CacheAware(CacheAwareConfig(cache_threshold=0.0)), make_workers(2)
    policy.pick(req("aaaa"), workers)
    choice = policy.pick(req("bbbb"), workers)
    assert choice.reason == "smallest_tree" and choice.worker is workers[1]


def test_forget_and_maintain():
    policy, workers = CacheAware(CacheAwareConfig(max_tree_size=50)), make_workers(2)
    for i in range(10):
        policy.pick(req(f"{i} " + "p" * 40), workers)
    assert sum(policy.tree_sizes().values()) > 100
    policy.maintain()
    assert all(size <= 50 for size in policy.tree_sizes().values())
    policy.forget(workers[0].url)
    assert workers[0].url not in policy.tree_sizes()
    # a forgotten worker that is still offered starts from an empty tree: no hit there
    choice = policy.pick(req("9 " + "p" * 40), [workers[0]])
    assert choice.reason == "smallest_tree"


def test_round_robin_cycles_and_survives_membership_changes():
    policy, workers = RoundRobin(), make_workers(3)
    assert [policy.pick(req(""), workers).worker for _ in range(6)] == workers * 2
    assert policy.pick(req(""), workers[:1]).worker is workers[0]  # one left: always it
    assert {policy.pick(req(""), workers[1:]).worker.url for _ in range(4)} == {workers[1].url, workers[2].url}


def test_least_load_picks_the_least_loaded_and_spreads_ties():
    policy, workers = LeastLoad(), make_workers(3, [5, 1, 3])
    assert policy.pick(req(""), workers).worker is workers[1]
    policy, idle = LeastLoad(), make_workers(3)
    assert Counter(policy.pick(req(""), idle).worker.url for _ in range(9)) == {w.url: 3 for w in idle}


def test_power_of_two_never_picks_the_most_loaded():
    policy, workers = PowerOfTwo(random.Random(0)), make_workers(3, [9, 1, 5])
    picked = Counter(policy.pick(req(""), workers).worker.url for _ in range(300))
    assert workers[0].url not in picked and set(picked) == {workers[1].url, workers[2].url}
    assert policy.pick(req(""), workers[:1]).worker is workers[0]


def test_make_policy_by_name():
    for name, cls in [("cache_aware", CacheAware), ("round_robin", RoundRobin), ("least_load", LeastLoad),
                      ("power_of_two", PowerOfTwo)]:
        policy = make_policy(name, CacheAwareConfig())
        assert isinstance(policy, cls) and policy.name == name
    with pytest.raises(ValueError, match="policy"):
        make_policy("random", CacheAwareConfig())
