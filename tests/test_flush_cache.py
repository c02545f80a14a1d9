"""Flushing the prefix cache in the engine (`Engine.flush_cache`, `LLM.flush_cache`; the server's
POST /flush_cache is tests/test_server_flush.py): every page no running request holds leaves the
device and the host tier, a request running through the flush keeps its pages and its greedy
output, and the engine's invariants (the shadow count of page holders, both tiers) hold after it.
Tiny random model, page size 4; the engine tests run with overlap scheduling off and on."""
from __future__ import annotations

import pytest
from conftest import assert_drained, collect, drain, make_tiny_engine

from ketch.engine.engine import Engine
from ketch.llm import LLM
from ketch.sampling.params import SamplingParams

PS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CACHED = [3 + i for i in range(18)]  # 4 full pages once run (18 prompt + 12 output - 1 computed)
RUNNING = [200 + 7 * i % 300 for i in range(14)]  # shares no page with CACHED
HIERARCHY = {
    "device only": {},
    "write_through": dict(enable_hierarchical_cache=True, hicache_write_policy="write_through"),
    "write_back": dict(enable_hierarchical_cache=True, hicache_write_policy="write_back"),
}


def run(engine: Engine, rid: str, ids: list[int]) -> list[int]:
    engine.add_request(rid, ids, GREEDY)
    return collect(drain(engine))[(rid, 0)]["ids"]  # drain checks the invariants after every step


def host_used(engine: Engine) -> int:
    host = engine.kv.host_pool
    return 0 if host is None else host.num_pages - host.num_free


@pytest.mark.usefixtures("run_engine_modes")
@pytest.mark.parametrize("switches", HIERARCHY.values(), ids=HIERARCHY.keys())
def test_flush_empties_every_tier_and_the_next_request_starts_cold(tiny_config_path: str, switches: dict) -> None:
    eng = make_tiny_engine(tiny_config_path, page_size=PS, **switches)
    first = run(eng, "a", CACHED)
    cached, on_host = eng.cache.cached_pages, host_used(eng)
    assert cached >= 4
    if switches:
        eng.kv.tree.evict(2)  # two pages go to the host only: the flush must find them there too
        assert host_used(eng) >= 2
        on_host = host_used(eng)
    freed = eng.flush_cache()
    assert freed["device"] == cached - (2 if switches else 0) and freed.get("host", 0) == on_host
    assert ("host" in freed) == bool(switches)
    assert eng.cache.cached_pages == 0 and eng.allocator.num_free == eng.allocator.num_pages
    assert host_used(eng) == 0
    eng.check_invariants()
    eng.kv.check_idle()
    eng.add_request("again", CACHED, GREEDY)
    outs = drain(eng)
    assert outs[0].num_cached_tokens == 0 and collect(outs)[("again", 0)]["ids"] == first  # cold, same answer
    assert eng.flush_cache()["device"] > 0 and eng.flush_cache() == {"device": 0, **({"host": 0} if switches else {})}


@pytest.mark.usefixtures("run_engine_modes")
@pytest.mark.parametrize("switches", HIERARCHY.values(), ids=HIERARCHY.keys())
def test_a_request_running_through_the_flush_keeps_its_pages_and_its_output(tiny_config_path: str,
                                                                            switches: dict) -> None:
    eng = make_tiny_engine(tiny_config_path, page_size=PS, **switches)
    want = run(eng, "ref", RUNNING)
    eng.flush_cache()
    run(eng, "other", CACHED)  # cached, held by nobody: the flush takes it
    eng.add_request("live", RUNNING, GREEDY)
    outs = []
    while len(collect(outs).get(("live", 0), {"ids": []})["ids"]) < 4:  # prefilled, published, decoding
        outs += eng.step()
    live = eng.requests["live"][0]
    held = set(live.page_table)
    assert live.cache_node is not None and eng.cache.cached_pages > 0
    assert eng.flush_cache()["device"] >= 4  # CACHED's pages
    eng.check_invariants()  # every page the request holds is still referenced as it was
    assert eng.kv.peek(CACHED) == 0  # the unheld conversation is gone ...
    assert set(live.page_table) == held and eng.cache.cached_pages == len(eng.cache.cached_page_set() & held)
    assert eng.cache.cached_pages > 0  # ... the running one's published pages stay (locked)
    outs += drain(eng)
    assert collect(outs)[("live", 0)]["ids"] == want
    if switches:
        eng.flush_cache()
        assert host_used(eng) == 0
    assert_drained(eng)


def test_llm_flush_cache(tiny_config_path: str) -> None:
    llm = LLM(tiny_config_path, load_format="dummy", dtype="float32", kv_cache_memory=64 * 2048, page_size=PS)
    first = llm.generate(CACHED, GREEDY)[0]
    assert llm.generate(CACHED, GREEDY)[0].num_cached_tokens > 0
    assert llm.flush_cache()["device"] >= 4
    again = llm.generate(CACHED, GREEDY)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    llm.engine.check_invariants()
