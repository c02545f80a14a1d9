"""The storage tier (L3) through the engine: greedy output identical with the hierarchy off, L2
only, L2 + file and L2 + Redis on a multi-turn workload 5x the device pool and 3x device + host
(pages really go to storage and come back: the per-tier hit counters); a restarted engine serves
an old conversation from storage; pages from storage land under their own tokens; the idle
audit; the options through the CLI and LLM. Faults (damaged pages, a dead or hung store, dropped
writes, bad options): test_hicache_l3_faults.py."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_drained, collect, drain, make_tiny_engine
from mooncake_master import MooncakeMaster, mooncake_master  # noqa: F401  (the fixture)
from redis_server import RedisServer, redis_server  # noqa: F401  (the fixture)
from server_util import parse_metrics
from test_hicache_l2 import DEVICE_PAGES, PARAMS, PS, assert_host_drained, multi_turn

from ketch.cache.page_hash import ROOT_HASH, chain_hashes
from ketch.cache.storage.file import FileStorage
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.server.metrics import ServerMetrics

HOST_RATIO = 1.5  # 36 host pages: device + host hold 60 of the workload's 120 pages


def l3_engine(config_path: str, url: str, backend: str = "file", **kw) -> Engine:
    kw.setdefault("hicache_ratio", HOST_RATIO)
    kw.setdefault("page_size", PS)
    return make_tiny_engine(config_path, kv_cache_memory=DEVICE_PAGES * 2048,
                            enable_hierarchical_cache=True, hicache_storage_backend=backend,
                            hicache_storage_url=url, **kw)


def file_url(path: Path) -> str:
    return f"file://{path}"


def finish(eng: Engine) -> None:
    """Every queued write lands, then every page of every tier is back."""
    assert eng.kv.storage is not None and eng.kv.storage.drain(30.0)
    assert_host_drained(eng)
    eng.close()


@pytest.fixture(scope="module")
def reference(tiny_config_path: str) -> list[list[int]]:
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS)
    answers = multi_turn(eng)
    assert_drained(eng)
    return answers


def test_l2_only_serves_less_from_cache_than_l2_plus_l3(tiny_config_path: str, reference, tmp_path: Path) -> None:
    """The yardstick for the L3 runs below: with this small host tier, L2 alone must lose pages
    (host evictions), so storage has something to serve."""
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS,
                           enable_hierarchical_cache=True, hicache_ratio=HOST_RATIO)
    assert multi_turn(eng) == reference
    assert eng.kv.tree.host_evicted_pages > 0 and eng.kv.hits.host_tokens > 0
    l2_cached = eng.scheduler.stats.cached_prompt_tokens
    assert_host_drained(eng)
    l3 = l3_engine(tiny_config_path, file_url(tmp_path / "kv"))
    assert multi_turn(l3) == reference
    assert l3.scheduler.stats.cached_prompt_tokens > l2_cached  # storage served what the host lost
    finish(l3)


@pytest.mark.parametrize("policy,ratio", [("write_through", HOST_RATIO), ("write_back", 2.0)])
def test_multi_turn_output_is_identical_with_a_file_l3(tiny_config_path: str, reference, tmp_path: Path,
                                                       policy: str, ratio: float) -> None:
    """write_back's host holds only evicted pages, and the six prompts waiting for storage pin
    their cached prefixes there: with the 1.5x host those pins leave no room to adopt into, so
    write_back runs with a 2x host (3x would keep everything on the host: no storage hit)."""
    eng = l3_engine(tiny_config_path, file_url(tmp_path / "kv"), hicache_write_policy=policy, hicache_ratio=ratio)
    assert multi_turn(eng) == reference
    s = eng.stats()
    assert s.storage_hit_tokens > 0 and s.host_hit_tokens > 0 and s.device_hit_tokens > 0
    assert s.storage_written_pages > 0 and s.storage_read_bytes > 0 and s.storage_prefetches > 0
    assert (s.storage_rejected_corrupt, s.storage_rejected_foreign, s.storage_dropped_writes) == (0, 0, 0)
    shown = parse_metrics(ServerMetrics().render(s).decode())
    assert shown['ketch_cache_hit_tokens_total{tier="storage"}'] == s.storage_hit_tokens
    assert shown["ketch_hicache_storage_written_pages_total"] == s.storage_written_pages
    assert shown['ketch_hicache_storage_rejected_pages_total{reason="corrupt"}'] == 0
    assert shown["ketch_hicache_storage_read_seconds_total"] == s.storage_read_seconds > 0
    assert shown["ketch_hicache_load_seconds_total"] == s.host_loaded_seconds > 0
    finish(eng)


def test_multi_turn_output_is_identical_with_a_redis_l3(tiny_config_path: str, reference,
                                                        redis_server: RedisServer) -> None:
    eng = l3_engine(tiny_config_path, redis_server.url, backend="redis")
    assert multi_turn(eng) == reference
    s = eng.stats()
    assert s.storage_hit_tokens > 0 and s.host_hit_tokens > 0 and s.storage_written_pages > 0
    finish(eng)


def test_multi_turn_output_is_identical_with_a_mooncake_l3(tiny_config_path: str, reference,
                                                           mooncake_master: MooncakeMaster) -> None:
    eng = l3_engine(tiny_config_path, mooncake_master.url(global_segment_mb=64, local_buffer_mb=16),
                    backend="mooncake")
    assert multi_turn(eng) == reference
    s = eng.stats()
    assert s.storage_hit_tokens > 0 and s.host_hit_tokens > 0 and s.storage_written_pages > 0
    finish(eng)


# ---- restart -------------------------------------------------------------------------------

LONG = [3 + (i * 7) % 400 for i in range(61)]  # 15 whole pages before the last token


def test_a_restarted_engine_serves_an_old_conversation_from_storage(tiny_config_path: str, tmp_path: Path) -> None:
    url = file_url(tmp_path / "kv")
    first = l3_engine(tiny_config_path, url)
    first.add_request("turn1", LONG, PARAMS)
    answer = collect(drain(first))[("turn1", 0)]["ids"]
    finish(first)
    history = LONG + answer + [5, 6, 7, 8, 9]
    second = l3_engine(tiny_config_path, url)  # a new process's engine: empty device and host tiers
    second.add_request("turn2", history, PARAMS)
    got = collect(drain(second))[("turn2", 0)]["ids"]
    prefix = len(LONG) + len(answer)
    assert second.scheduler.stats.cached_prompt_tokens >= 0.9 * prefix
    assert second.stats().storage_hit_tokens == second.scheduler.stats.cached_prompt_tokens
    cold = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS)
    cold.add_request("turn2", history, PARAMS)
    assert got == collect(drain(cold))[("turn2", 0)]["ids"]
    finish(second)



def test_the_same_weights_and_options_share_a_fingerprint_and_others_do_not(tiny_config_path: str,
                                                                            tmp_path: Path) -> None:
    a = l3_engine(tiny_config_path, file_url(tmp_path / "a")).kv.storage.format  # type: ignore[union-attr]
    b = l3_engine(tiny_config_path, file_url(tmp_path / "b")).kv.storage.format  # type: ignore[union-attr]
    c = l3_engine(tiny_config_path, file_url(tmp_path / "c"), page_size=8).kv.storage.format  # type: ignore[union-attr]
    assert a.fingerprint == b.fingerprint and a.key(b"\x01") == b.key(b"\x01")
    assert a.key(b"\x01") != c.key(b"\x01")  # another page size: another key


def test_pages_from_storage_land_under_their_own_tokens(tiny_config_path: str, tmp_path: Path) -> None:
    """Bit for bit: the K/V a restarted engine loads from storage for a prompt is the K/V the
    first engine computed for the same pages (a tiny random model's greedy output cannot tell
    pages apart; this can)."""
    first = l3_engine(tiny_config_path, file_url(tmp_path / "kv"))
    first.add_request("a", LONG, PARAMS)
    drain(first)
    computed = {h: [t[p].clone() for layer in first.kv.pool.layers for t in layer.values()]
                for node in first.cache.nodes() for h, p in zip(node.hashes, node.pages)}
    finish(first)
    second = l3_engine(tiny_config_path, file_url(tmp_path / "kv"))
    second.add_request("b", LONG, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while not second.scheduler.running:
        second.step()
    req = second.scheduler.running[0]
    hashes = chain_hashes(ROOT_HASH, LONG[: (len(LONG) - 1) // PS * PS], PS)
    assert req.num_cached_prompt == len(hashes) * PS == second.stats().storage_hit_tokens
    for i, h in enumerate(hashes):
        loaded = [t[req.page_table[i]] for layer in second.kv.pool.layers for t in layer.values()]
        assert all(a.equal(b) for a, b in zip(loaded, computed[h], strict=True)), f"page {i}"
    drain(second)
    finish(second)


def smol_turns(llm, history: list[list[int]], turns: range) -> list[list[int]]:
    """test_hicache_l2's SmolLM2 conversations, for some of their turns (histories extended in place)."""
    from test_hicache_l2 import SMOL_TOPICS

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    answers = []
    for _ in turns:
        for c, topic in enumerate(SMOL_TOPICS):
            history[c] += llm.tokenizer.encode(f" Tell me one more short fact about {topic}, please.",
                                               add_special_tokens=False)
        for c, out in enumerate(llm.generate(history, params)):
            answers.append(out.token_ids)
            history[c] += out.token_ids
        llm.engine.check_invariants()
    return answers


def test_smollm_conversations_continue_from_storage_after_a_restart(smollm_path: str, tmp_path: Path) -> None:
    """Real weights, whose attention tells pages apart: two turns of five conversations through a
    small device pool (18 pages) and host tier (36), the engine closed; a new engine, empty on
    device and host, answers the third turn from their histories in storage exactly as one engine
    without any hierarchy answers all three."""
    from test_hicache_l2 import SMOL_PAGES, SMOL_TOPICS

    from ketch.llm import LLM

    def llm(**switches):
        return LLM(smollm_path, dtype="float32", page_size=PS, kv_cache_memory=SMOL_PAGES * 4 * 46_080,
                   max_num_seqs=1, **switches)

    ref = smol_turns(llm(), [[] for _ in SMOL_TOPICS], range(3))
    # host 2x the device: write_through mirrors the 18 device pages there, and a restarted engine
    # stages a whole history (~11 pages) from storage into what is left
    l3 = dict(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_storage_backend="file",
              hicache_storage_url=file_url(tmp_path / "kv"))
    first, history = llm(**l3), [[] for _ in SMOL_TOPICS]
    assert smol_turns(first, history, range(2)) == ref[:10]
    assert first.engine.stats().storage_written_pages > 0
    finish(first.engine)
    second = llm(**l3)
    assert smol_turns(second, history, range(1)) == ref[10:]
    s = second.engine.stats()
    assert s.storage_hit_tokens > 0.5 * s.prompt_tokens  # most of each history came back from storage
    finish(second.engine)


def test_the_idle_audit_counts_a_leaked_page_and_the_engine_keeps_serving(tiny_config_path: str,
                                                                          tmp_path: Path) -> None:
    """The server's idle-time audit (Engine.audit_if_due): every tier's accounting after work,
    at most once per interval; a leaked reference is logged and counted, not raised."""
    eng = l3_engine(tiny_config_path, file_url(tmp_path / "kv"))
    eng.audit_if_due()
    assert eng.audits == 0  # no step since the last audit (none): nothing to check
    eng.add_request("a", LONG, PARAMS)
    drain(eng)
    eng.audit_if_due()
    assert (eng.audits, eng.audit_failures) == (1, 0)
    eng.add_request("b", LONG + [1], PARAMS)
    drain(eng)
    leaked = eng.allocator.alloc(1)  # a page nobody accounts for
    eng.audit_if_due()
    assert eng.audits == 1  # within the interval: not yet
    eng._audited_at -= 10.0  # the interval has passed
    eng.audit_if_due()
    assert (eng.audits, eng.audit_failures) == (2, 1)
    assert eng.stats().audit_failures == 1
    eng.add_request("c", LONG + [2], PARAMS)  # still serving
    assert len(collect(drain_unchecked(eng))[("c", 0)]["ids"]) == PARAMS.max_tokens
    eng.allocator.decref(leaked)
    finish(eng)


def drain_unchecked(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def test_cli_flags_and_llm_take_the_l3_options(tiny_config_path: str, tmp_path: Path) -> None:
    from ketch.cli import build_parser
    from ketch.cli_args import engine_kwargs
    from ketch.llm import LLM

    url = file_url(tmp_path / "kv")
    flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--hicache-storage-url", url,
             "--hicache-prefetch-timeout", "0.25", "--hicache-storage-write-queue", "7"]
    for argv in (["serve", *flags], ["bench", "offline", *flags]):
        cfg = EngineConfig(**engine_kwargs(build_parser().parse_args(argv)))
        assert (cfg.hicache_storage_backend, cfg.hicache_storage_url, cfg.hicache_prefetch_timeout,
                cfg.hicache_storage_write_queue) == ("file", url, 0.25, 7)
    llm = LLM(tiny_config_path, load_format="dummy", dtype="float32", kv_cache_memory=8 * 2048, page_size=PS,
              enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_url=url,
              hicache_prefetch_timeout=0.25, hicache_storage_write_queue=7)
    storage = llm.engine.kv.storage
    assert storage is not None and storage.prefetch_timeout == 0.25 and storage._queue.maxsize == 7
    assert isinstance(storage.backend, FileStorage) and str(storage.backend.root) == str(tmp_path / "kv")
    llm.engine.close()


def over_a_stored_long(config_path: str, tmp_path: Path) -> Engine:
    """A fresh engine on a file store that an engine before it filled with LONG's pages."""
    url = file_url(tmp_path / "kv")
    first = l3_engine(config_path, url)
    first.add_request("a", LONG, PARAMS)
    drain(first)
    finish(first)
    return l3_engine(config_path, url)


def test_a_prefetch_pins_the_cached_prefix_its_pages_continue(tiny_config_path: str, tmp_path: Path) -> None:
    """While a prompt's pages travel from storage and until the request is admitted, the prefix
    they continue (then the pages adopted) is locked: a flush (or eviction under load) cannot
    leave them behind a gap, which would waste the whole read; the pin is visible to the
    invariants and gone after."""
    eng = over_a_stored_long(tiny_config_path, tmp_path)
    eng.add_request("head", LONG[:21], SamplingParams(temperature=0.0, max_tokens=1))
    drain(eng)  # five pages of LONG cached (and read from storage: they were there)
    whole = (len(LONG) - 1) // PS
    job = eng.kv.prefetch(LONG)
    assert job is not None and job.first_page == 5 and job.done.wait(10.0)
    eng.kv.flush()  # everything unpinned goes, on both tiers
    eng.check_invariants()  # the pin is accounted for
    assert eng.kv.tree.peek(LONG) == 5 * PS
    assert eng.kv.settle_prefetch(job) == (whole - 5) * PS
    eng.kv.flush()  # the pin moved onto the adopted pages: they stay too
    eng.check_invariants()
    assert eng.kv.tree.peek(LONG) == whole * PS and eng.kv.pins == [job]
    eng.kv.unpin(job)
    eng.kv.unpin(job)  # idempotent (a request's n samples share one job)
    assert not eng.kv.pins
    eng.check_invariants()
    finish(eng)


def test_storage_is_asked_when_a_queued_request_is_admitted(tiny_config_path: str, tmp_path: Path) -> None:
    """A request whose prefix is cached when it arrives, then evicted from device and host while
    it queues behind others (one sequence at a time), is served from storage when its turn
    comes: storage is asked at admission, about the cache as it is then."""
    eng = l3_engine(tiny_config_path, file_url(tmp_path / "kv"), max_num_seqs=1)
    eng.add_request("a", LONG, PARAMS)
    drain(eng)
    assert eng.kv.storage.drain(10.0)  # type: ignore[union-attr]
    for i in range(5):  # 5 x 15 pages: more than device (24) and host (36) hold together
        eng.add_request(f"evict{i}", [3 + (i * 97 + j * 13) % 450 for j in range(61)], PARAMS)
    query = LONG + [11, 12, 13, 14, 15]
    eng.add_request("b", query, PARAMS)
    assert eng.kv.tree.peek(query) == (len(LONG) - 1) // PS * PS  # all of it cached on arrival
    got = collect(drain(eng))[("b", 0)]["ids"]
    s = eng.stats()
    assert s.storage_hit_tokens >= 10 * PS
    cold = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS)
    cold.add_request("b", query, PARAMS)
    assert got == collect(drain(cold))[("b", 0)]["ids"]
    finish(eng)


def test_a_closed_llm_refuses_requests_and_a_new_one_reads_what_it_stored(tiny_config_path: str, tmp_path: Path) -> None:
    """close() stops the L3 threads: a request to the closed LLM failed inside a step with
    concurrent.futures' 'cannot schedule new futures after shutdown' (its prefetch), or ran with
    its writes lost; now it is refused up front. A new LLM in the same process serves from the store."""
    from ketch.llm import LLM

    kw = dict(load_format="dummy", dtype="float32", kv_cache_memory=8 * 2048, page_size=PS,
              enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_url=file_url(tmp_path / "kv"))
    prompt = [3 + (i * 7) % 500 for i in range(21)]
    first = LLM(tiny_config_path, **kw)
    want = first.generate([prompt], PARAMS)[0].token_ids
    first.close()
    first.flush_cache()  # the pages now only in the store: a request would have to read them
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"close\(\) was called"):
            first.generate([prompt], PARAMS)
        assert not first.engine.requests and not first.engine.has_unfinished()
    second = LLM(tiny_config_path, **kw)
    assert second.generate([prompt], PARAMS)[0].token_ids == want
    assert second.engine.stats().storage_hit_tokens == (len(prompt) - 1) // PS * PS
    second.close()
