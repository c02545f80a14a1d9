"""The host tier (L2) under the KV manager: HostPool copies, device eviction to the host, host LRU
eviction, load-back on a hit, adoption of the caller's pages, aborts, and a randomized workload
that checks every page's contents (a page loaded into the wrong place fails it)."""
from __future__ import annotations

import random

import pytest
import torch

from page_holder import Holder
from ketch.cache.hiradix import HiRadixCache
from ketch.cache.host_pool import HostPool, host_pages_for
from ketch.cache.kv_pool import KVPool
from ketch.cache.manager import KVCacheManager
from ketch.config import EngineConfig, KVSpec

PS = 4
LAYERS = 2


def manager(device_pages: int, host_pages: int, policy: str = "write_through",
            dtype: torch.dtype = torch.float32) -> KVCacheManager:
    pool = KVPool(KVSpec.mha(LAYERS, 1, 4), device_pages, PS, dtype, torch.device("cpu"),
                  compute_dtype=torch.float32)
    return KVCacheManager(pool, host_pool=HostPool(pool, host_pages), write_policy=policy)


def value(token: int, pos: int, layer: int, name: str) -> float:
    """What the 'model' writes for a token: a function of the token, its position, layer and tensor
    (identical prefixes hold identical K/V, as in a real model)."""
    return (token * 256 + pos) * (1 if name == "k" else -1) + layer * 0.5


def compute(kv: KVCacheManager, h: Holder, upto: int) -> None:
    """The forward of tokens [num_computed, upto): write their K/V into the holder's slots, publish."""
    for pos in range(h.num_computed, upto):
        slot = torch.tensor([h.page_table[pos // PS] * PS + pos % PS])
        for layer in range(LAYERS):
            for name in ("k", "v"):
                kv.pool.write(layer, name, slot, torch.full((1, 1, 4), value(h.ids[pos], pos, layer, name)))
    h.num_computed = upto
    kv.publish(h)


def assert_contents(kv: KVCacheManager, h: Holder) -> None:
    """Every computed token of the holder (its hit included) reads back what the model wrote."""
    for pos in range(h.num_computed):
        slot = h.page_table[pos // PS] * PS + pos % PS
        for layer in range(LAYERS):
            for name in ("k", "v"):
                got = kv.pool.tensor(layer, name).view(-1, 1, 4)[slot].float()
                want = value(h.ids[pos], pos, layer, name)
                assert torch.all(got == want), f"token {pos} layer {layer} {name}: {got.flatten()[0]} != {want}"


def run(kv: KVCacheManager, ids: list[int], *, keep: bool = False, others: tuple[Holder, ...] = ()) -> Holder:
    """Admit `ids`, compute them, release (unless keep); returns the holder. `others`: holders
    that hold pages meanwhile (for the shadow count)."""
    h = Holder(list(ids))
    assert kv.admit(h, kv.match(h.ids[:-1]), len(ids))
    assert_contents(kv, h)  # the hit, loaded back or not, holds the right K/V
    compute(kv, h, len(ids))
    kv.check_invariants([h, *others])
    if not keep:
        kv.release(h)
        kv.check_invariants(others)
    return h


def drained(kv: KVCacheManager) -> None:
    kv.check_invariants([])
    kv.check_idle()
    kv.tree.reset()
    assert kv.allocator.num_free == kv.pool.num_pages
    assert kv.host_pool is not None and kv.host_pool.num_free == kv.host_pool.num_pages
    kv.check_invariants([])


def conv(seed: int, n: int) -> list[int]:
    return [seed * 10 + i % 7 for i in range(n)]


# ---- host pool -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_pool_round_trip_moves_whole_pages_of_every_tensor(dtype: torch.dtype) -> None:
    pool = KVPool(KVSpec.mha(LAYERS, 2, 4), 6, PS, dtype, "cpu", compute_dtype=torch.float32)
    for layer in pool.layers:
        for t in layer.values():
            t.copy_(torch.randn(t.shape).clamp(-4, 4).to(dtype))
    before = [{n: t.clone() for n, t in layer.items()} for layer in pool.layers]
    host = HostPool(pool, 5)
    assert host.layers[0]["k"].shape == (5, PS, 2, 4) and host.layers[0]["k"].dtype == dtype
    assert not host.layers[0]["k"].is_pinned()  # plain memory for a CPU pool
    host.save([4, 1], [0, 3])
    host.load([3, 0], [2, 5])  # page 1 → host 3 → page 2; page 4 → host 0 → page 5
    for layer, old in zip(pool.layers, before, strict=True):
        for n, t in layer.items():
            was = old[n].view(torch.uint8)
            assert t[2].view(torch.uint8).equal(was[1]) and t[5].view(torch.uint8).equal(was[4])
            for p in (0, 1, 3, 4):
                assert t[p].view(torch.uint8).equal(was[p]), "an untouched page changed"
    assert host.stats.saved_pages == host.stats.loaded_pages == 2
    assert host.stats.saved_bytes == 2 * pool.bytes_per_page
    with pytest.raises(ValueError, match="save"):
        host.save([1], [0, 1])


def test_host_pool_size_from_ratio_or_gigabytes() -> None:
    pool = KVPool(KVSpec.mha(LAYERS, 1, 4), 10, PS, torch.float32, "cpu")
    on = dict(model="x", enable_hierarchical_cache=True)
    assert host_pages_for(pool, EngineConfig(**on)) == 20  # ratio 2.0, SGLang's default
    assert host_pages_for(pool, EngineConfig(**on, hicache_ratio=3.5)) == 35
    gb = EngineConfig(**on, hicache_ratio=3.5, hicache_size=pool.bytes_per_page * 7 / 1e9)
    assert host_pages_for(pool, gb) == 7  # the size wins over the ratio
    # more than the machine has: refused at startup, naming the field that asked (it was accepted,
    # and the pages filled until the OOM killer came)
    assert host_pages_for(pool, gb, available=7 * pool.bytes_per_page) == 7
    with pytest.raises(ValueError, match=r"^hicache_size: the host KV pool would take .* GB, more than the"):
        host_pages_for(pool, gb, available=7 * pool.bytes_per_page - 1)
    with pytest.raises(ValueError, match="^hicache_ratio: "):
        host_pages_for(pool, EngineConfig(**on, hicache_ratio=1e12))  # the machine's own available memory
    with pytest.raises(ValueError, match="hicache_size"):
        HostPool(pool, 0)


# ---- eviction to the host and load-back ------------------------------------------------------

@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_pages_go_to_the_host_and_a_hit_loads_them_back(policy: str) -> None:
    kv = manager(device_pages=7, host_pages=16, policy=policy)
    a = conv(1, 17)  # 4 full pages + 1 token
    run(kv, a)
    assert kv.host_pool.num_used == (4 if policy == "write_through" else 0)  # copied at publish, or not yet
    run(kv, conv(2, 25))  # 7 pages: a's 4 pages must leave the device
    node = kv.tree.root.children[tuple(a[:PS])]
    assert node.tier == "host" and node.pages == [] and len(node.host) == 4
    assert kv.tree.peek(a) == 16
    hit = kv.match(a + [99])
    assert (hit.tier, hit.length, hit.host_tokens, hit.pages) == ("host", 16, 16, [])
    h = run(kv, a + [99], keep=True)  # run() checks the loaded pages' contents
    assert node.tier == "both" and h.page_table[:4] == node.pages
    assert kv.hits.host_tokens == 16 and kv.host_pool.stats.loaded_pages == 4
    kv.release(h)
    drained(kv)


def test_a_hit_can_be_part_device_part_host() -> None:
    kv = manager(device_pages=12, host_pages=16, policy="write_back")
    a = conv(3, 17)
    run(kv, a)
    assert kv.tree.evict(2) == 2  # the tail half of a's node goes to the host, exactly 2 pages
    tiers = [n.tier for n in kv.tree.nodes()]
    assert sorted(tiers) == ["device", "host"]
    hit = kv.match(a)
    assert hit.length == 16 and hit.device_tokens == 8 and hit.host_tokens == 8 and len(hit.pages) == 2
    h = run(kv, a, keep=True)
    assert kv.hits.device_tokens == 8 and kv.hits.host_tokens == 8
    assert [n.tier for n in kv.tree.nodes()] == ["device", "both"]
    kv.release(h)
    drained(kv)


def test_host_eviction_is_lru_over_host_only_leaves() -> None:
    kv = manager(device_pages=3, host_pages=4, policy="write_back")
    x, y, z = conv(1, 9), conv(2, 9), conv(3, 9)  # 2 full pages each (3 while running)
    for ids in (x, y, z):
        run(kv, ids)  # each run evicts the previous conversation to the host
    assert kv.tree.peek(x) == kv.tree.peek(y) == kv.tree.peek(z) == 8
    assert kv.host_pool.num_free == 0
    kv.match(x)  # x is now the most recently used host-only leaf; y the least
    run(kv, conv(4, 9))  # z goes to the host; the host is full: its LRU leaf (y) is freed
    assert kv.tree.peek(y) == 0 and kv.tree.peek(x) == 8 and kv.tree.peek(z) == 8
    assert kv.tree.host_evicted_pages == 2
    drained(kv)


def test_a_node_without_room_on_the_host_leaves_both_tiers() -> None:
    kv = manager(device_pages=8, host_pages=2, policy="write_back")
    p, q = conv(1, 9), conv(2, 9)
    run(kv, p)
    kv.tree.evict(2)  # p to the host: the host is full
    run(kv, p)  # p loaded back: on both tiers, so its host pages cannot be evicted
    run(kv, q)
    kv.match(p)  # q is the least recently used device leaf
    assert kv.tree.evict(2) == 2
    assert kv.tree.peek(q) == 0 and kv.tree.dropped_pages == 2  # no host room: dropped
    assert [n.tier for n in kv.tree.nodes()] == ["both"]
    drained(kv)


def test_admission_that_cannot_make_room_leaves_host_nodes_unlocked_and_whole() -> None:
    kv = manager(device_pages=4, host_pages=8, policy="write_through")
    a = conv(1, 9)
    run(kv, a)
    other = Holder(conv(2, 16))
    assert kv.admit(other, kv.match(other.ids[:-1]), 16)  # every device page; a's node to the host
    hit = kv.match(a)
    assert hit.host_tokens == 8
    late = Holder(list(a))
    assert not kv.admit(late, hit, 9)  # 3 pages: none free, nothing evictable
    assert late.page_table == [] and late.cache_node is None
    assert all(n.lock_ref == 0 for n in kv.tree.nodes() if n.tier == "host")
    kv.check_invariants([other])
    kv.release(other)
    run(kv, a)  # the host copy is still good
    drained(kv)


def test_release_before_computing_returns_host_loaded_pages() -> None:
    """An abort right after admission: the loaded pages stay cached (tree) and the holder's
    references all come back, on both tiers."""
    kv = manager(device_pages=7, host_pages=16, policy="write_back")
    a = conv(1, 17)
    run(kv, a)
    run(kv, conv(2, 25))
    h = Holder(a + [7, 7, 7])
    assert kv.admit(h, kv.match(h.ids[:-1]), len(h.ids))
    assert h.num_computed == 16 and kv.hits.host_tokens == 16
    kv.check_invariants([h])
    kv.release(h)  # aborted before its first step
    kv.check_invariants([])
    kv.check_idle()
    assert kv.tree.peek(a) == 16
    drained(kv)


def test_an_insert_through_host_only_nodes_adopts_the_callers_pages() -> None:
    """A request that computed a prefix itself (admitted before it was cached) publishes it after
    the cached copy went to the host: the node takes the request's device pages again."""
    kv = manager(device_pages=12, host_pages=16, policy="write_back")
    ids = conv(1, 13)
    b = Holder(ids + [5, 5, 5, 5])
    assert kv.admit(b, kv.match(b.ids[:-1]), len(b.ids))  # a miss: the prefix is not cached yet
    run(kv, ids, others=(b,))  # another request caches the prefix
    kv.tree.evict(kv.tree.evictable_pages)  # ... and it goes to the host
    node = kv.tree.root.children[tuple(ids[:PS])]
    assert node.tier == "host"
    compute(kv, b, len(b.ids))  # b publishes 4 pages: 3 through the host-only node, 1 new
    assert node.tier == "both" and node.pages == b.page_table[:3]
    assert b.cache_node is not None and b.cache_node.pages == b.page_table[3:4]
    kv.check_invariants([b])
    kv.release(b)
    drained(kv)


# ---- randomized workload -----------------------------------------------------------------------

@pytest.mark.parametrize("policy,seed", [("write_through", 0), ("write_back", 1), ("write_back", 2)])
def test_random_workload_keeps_contents_and_invariants(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    kv = manager(device_pages=24, host_pages=40, policy=policy)
    assert isinstance(kv.tree, HiRadixCache)
    bases = [[rng.randrange(6) for _ in range(40)] for _ in range(4)]
    live: list[Holder] = []
    for _ in range(600):
        op = rng.random()
        if op < 0.35 or not live:
            base = rng.choice(bases)
            h = Holder(base[: rng.randint(0, 40)] + [rng.randrange(6) for _ in range(rng.randint(1, 8))])
            if kv.admit(h, kv.match(h.ids[:-1]), len(h.ids)):
                assert_contents(kv, h)
                live.append(h)
        elif op < 0.7:  # a step of a running request: a chunk of its tokens
            h = rng.choice(live)
            compute(kv, h, min(len(h.ids), h.num_computed + rng.randint(1, 12)))
        elif op < 0.95:  # finish or abort
            h = live.pop(rng.randrange(len(live)))
            assert_contents(kv, h)
            kv.release(h)
        else:
            kv.tree.evict_host(rng.randint(1, 6))
        kv.check_invariants(live)
    for h in live:
        kv.release(h)
    kv.check_idle()
    assert kv.hits.host_tokens > 0 and kv.host_pool.stats.loaded_pages > 0
    drained(kv)
