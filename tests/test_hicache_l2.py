"""The hierarchical cache's host tier (L2) through the engine: greedy output identical with the
hierarchy off, write_through and write_back on a multi-turn workload whose working set is 5x a
tiny device pool (pages really go to the host and come back: the host-tier hit counter), aborts,
invariants on both tiers after every step, every page back after drain; the config errors."""
from __future__ import annotations

import pytest
from conftest import assert_drained, collect, drain, make_tiny_engine
from server_util import parse_metrics

from ketch.cli import build_parser, main
from ketch.cli_args import engine_kwargs
from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.llm import LLM
from ketch.sampling.params import SamplingParams
from ketch.server.metrics import ServerMetrics

PS = 4
DEVICE_PAGES = 24  # the tiny model's pages are 2,048 bytes
CONVERSATIONS, TURNS, USER_LEN, ANSWER_LEN = 6, 5, 10, 6  # 6 x 5 x 16 tokens = 120 pages = 5 x the pool
PARAMS = SamplingParams(temperature=0.0, max_tokens=ANSWER_LEN, ignore_eos=True)


def user_turn(conv: int, turn: int) -> list[int]:
    return [3 + (conv * 37 + turn * 11 + i * 5) % 500 for i in range(USER_LEN)]


def multi_turn(engine: Engine) -> list[list[int]]:
    """Each round sends every conversation's whole history plus a new user turn (all at once);
    returns each conversation's answers, turn by turn."""
    history: list[list[int]] = [[] for _ in range(CONVERSATIONS)]
    answers: list[list[int]] = []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            history[c] = history[c] + user_turn(c, turn)
            engine.add_request(f"c{c}t{turn}", history[c], PARAMS)
        res = collect(drain(engine))  # drain checks the invariants of both tiers after every step
        for c in range(CONVERSATIONS):
            out = res[(f"c{c}t{turn}", 0)]["ids"]
            answers.append(out)
            history[c] = history[c] + out
    return answers


def scraped(engine: Engine) -> dict[str, float]:
    """The engine's stats as /metrics renders them: {'name{labels}': value}."""
    return parse_metrics(ServerMetrics().render(engine.stats()).decode())


def assert_host_drained(engine: Engine) -> None:
    assert_drained(engine)  # resets the tree: device pages all free ...
    host = engine.kv.host_pool
    assert host is not None and host.num_free == host.num_pages  # ... and host pages too


@pytest.fixture(scope="module")
def reference(tiny_config_path: str) -> tuple[list[list[int]], int]:
    """The hierarchy off: answers and cached prompt tokens."""
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS)
    assert eng.allocator.num_pages == DEVICE_PAGES and eng.kv.host_pool is None
    answers = multi_turn(eng)
    shown = scraped(eng)
    assert shown['ketch_cache_hit_tokens_total{tier="host"}'] == 0 and "ketch_kv_host_pages_total" not in shown
    assert shown['ketch_cache_hit_tokens_total{tier="device"}'] == eng.kv.hits.device_tokens > 0
    assert_drained(eng)
    return answers, eng.scheduler.stats.cached_prompt_tokens


@pytest.mark.parametrize("switches", [
    dict(hicache_write_policy="write_through", hicache_ratio=8.0),
    dict(hicache_write_policy="write_back", hicache_ratio=8.0),
    dict(hicache_write_policy="write_back"),  # 2x: the host evicts too
    dict(hicache_write_policy="write_through", hicache_ratio=8.0, overlap_schedule=True, chunked_prefill_size=8),
], ids=["write_through", "write_back", "write_back-small-host", "write_through-overlap-chunked"])
def test_multi_turn_output_is_identical_and_hits_the_host(tiny_config_path: str, reference, switches: dict) -> None:
    ref_answers, ref_cached = reference
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=DEVICE_PAGES * 2048, page_size=PS,
                           enable_hierarchical_cache=True, **switches)
    assert eng.allocator.num_pages == DEVICE_PAGES
    assert eng.kv.host_pool is not None and eng.kv.host_pool.num_pages == DEVICE_PAGES * switches.get("hicache_ratio", 2.0)
    assert multi_turn(eng) == ref_answers
    host = eng.kv.host_pool
    assert eng.kv.hits.host_tokens > 0 and host.stats.loaded_pages > 0 and host.stats.saved_pages > 0
    shown = scraped(eng)  # what /metrics says: the same counters, per tier
    assert shown['ketch_cache_hit_tokens_total{tier="host"}'] == eng.kv.hits.host_tokens
    assert shown['ketch_cache_hit_tokens_total{tier="device"}'] == eng.kv.hits.device_tokens
    assert shown["ketch_hicache_loaded_bytes_total"] == host.stats.loaded_bytes == host.stats.loaded_pages * host.bytes_per_page
    assert shown["ketch_hicache_saved_bytes_total"] == host.stats.saved_bytes > 0
    assert shown["ketch_kv_host_pages_total"] == host.num_pages
    assert eng.scheduler.stats.cached_prompt_tokens > ref_cached  # the host served what the device lost
    if "hicache_ratio" not in switches:
        assert eng.kv.tree.host_evicted_pages > 0
    assert_host_drained(eng)


def test_abort_while_holding_pages_loaded_from_the_host(tiny_config_path: str) -> None:
    eng = make_tiny_engine(tiny_config_path, kv_cache_memory=8 * 2048, page_size=PS,
                           enable_hierarchical_cache=True, hicache_write_policy="write_back")
    first = list(range(10, 30))
    eng.add_request("a", first, PARAMS)
    eng.add_request("b", list(range(100, 120)), PARAMS)  # pushes a's pages to the host
    drain(eng)
    loaded = eng.kv.host_pool.stats.loaded_pages
    eng.add_request("again", first + [7, 8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()  # admitted: a's prefix comes back from the host
    eng.check_invariants()
    assert eng.kv.host_pool.stats.loaded_pages > loaded and eng.scheduler.running
    eng.abort("again")
    outs = drain(eng)
    assert [o.finish_reason for o in outs] == ["abort"]
    eng.check_invariants()
    assert_host_drained(eng)


# ---- configuration ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw,field", [
    (dict(hicache_size=4.0), "hicache_size"),
    (dict(hicache_ratio=3.0), "hicache_ratio"),
    (dict(hicache_write_policy="write_back"), "hicache_write_policy"),
    (dict(hicache_io_backend="direct"), "hicache_io_backend"),
])
def test_a_hicache_option_without_the_switch_says_to_add_it(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} .*add --enable-hierarchical-cache"):
        EngineConfig(**kw)
    EngineConfig(enable_hierarchical_cache=True, **kw)  # with the switch: fine


@pytest.mark.parametrize("kw,field", [
    (dict(hicache_write_policy="write_around"), "hicache_write_policy"),
    (dict(hicache_io_backend="kernels"), "hicache_io_backend"),
    (dict(hicache_ratio=1.0), "hicache_ratio"),
    (dict(hicache_size=0.0), "hicache_size"),
    (dict(hicache_size=float("inf")), "hicache_size"),  # was an OverflowError at startup
    (dict(hicache_ratio=float("inf")), "hicache_ratio"),
    (dict(enable_prefix_cache=False), "enable_hierarchical_cache"),
    (dict(tensor_parallel_size=2), "enable_hierarchical_cache"),
    (dict(hicache_ratio="2"), "hicache_ratio"),  # a JSON config's string: was a bare TypeError
    (dict(hicache_ratio=None), "hicache_ratio"),
    (dict(hicache_size="1"), "hicache_size"),
    (dict(hicache_size=True), "hicache_size"),  # was taken as 1 GB
    (dict(enable_prefix_cache="false"), "enable_prefix_cache"),
])
def test_bad_hicache_values_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(enable_hierarchical_cache=True, **kw)


@pytest.mark.parametrize("value", ["false", "off", 1, None])
def test_the_switch_must_be_a_bool(value) -> None:
    """enable_hierarchical_cache="false" is truthy: it turned the host tier on, silently."""
    with pytest.raises(ValueError, match="^enable_hierarchical_cache must be a bool"):
        EngineConfig(enable_hierarchical_cache=value)


def test_cli_flags_reach_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    flags = ["--enable-hierarchical-cache", "--hicache-size", "0.5", "--hicache-write-policy", "write_back",
             "--hicache-io-backend", "direct"]
    for argv in (["serve", *flags], ["generate", "hi", *flags], ["bench", "offline", *flags]):
        cfg = EngineConfig(**engine_kwargs(parser.parse_args(argv)))
        assert (cfg.enable_hierarchical_cache, cfg.hicache_size, cfg.hicache_write_policy, cfg.hicache_io_backend) \
            == (True, 0.5, "write_back", "direct")
    default = EngineConfig(**engine_kwargs(parser.parse_args(["serve"])))
    assert default.enable_hierarchical_cache is False and default.hicache_io_backend == "kernel"
    assert main(["generate", "hi", "--hicache-size", "4"]) == 2  # before any model loads
    assert "add --enable-hierarchical-cache" in capsys.readouterr().err


def test_llm_takes_the_options(tiny_config_path: str) -> None:
    llm = LLM(tiny_config_path, load_format="dummy", dtype="float32", kv_cache_memory=8 * 2048, page_size=PS,
              enable_hierarchical_cache=True, hicache_ratio=3.0, hicache_write_policy="write_back",
              hicache_io_backend="kernel")  # the CPU copies in place: accepted, no kernels
    assert llm.engine.kv.host_pool is not None and llm.engine.kv.host_pool.num_pages == 24
    assert llm.config.hicache_io_backend == "kernel" and llm.engine.kv.host_pool.loader is None
    assert llm.engine.kv.tree.write_policy == "write_back"  # type: ignore[attr-defined]


# ---- the bundled SmolLM2 (real weights, fp32) ------------------------------------------------

SMOL_TOPICS = ["the sea", "a clock", "bread", "the moon", "rivers"]
SMOL_PAGES = 18  # page_size 4: 72 tokens; the 5 conversations' ~75 pages are > 4x that


def smol_multi_turn(llm: LLM) -> list[list[int]]:
    """5 conversations x 3 turns of real text, each turn re-sending the whole conversation."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    history = [[] for _ in SMOL_TOPICS]
    answers = []
    for turn in range(3):
        for c, topic in enumerate(SMOL_TOPICS):
            history[c] = history[c] + llm.tokenizer.encode(f" Tell me one more short fact about {topic}, please.",
                                                           add_special_tokens=False)
        outs = llm.generate(history, params)
        llm.engine.check_invariants()
        for c, out in enumerate(outs):
            answers.append(out.token_ids)
            history[c] = history[c] + out.token_ids
    return answers


def test_smollm_multi_turn_output_is_identical_with_the_host_tier(smollm_path: str) -> None:
    """Real weights (attention that tells pages apart), write_back (the policy whose copy happens
    at eviction); write_through and the other switches run on the tiny model above."""
    runs = {}
    for name, switches in [("off", {}), ("write_back", dict(enable_hierarchical_cache=True, hicache_ratio=8.0,
                                                            hicache_write_policy="write_back"))]:
        llm = LLM(smollm_path, dtype="float32", page_size=PS, kv_cache_memory=SMOL_PAGES * 4 * 46_080,
                  max_num_seqs=1, **switches)  # one at a time: no preemption churn on 2 cores
        assert llm.engine.allocator.num_pages == SMOL_PAGES
        runs[name] = smol_multi_turn(llm)
        if switches:
            assert llm.engine.kv.hits.host_tokens > 0
            assert_host_drained(llm.engine)
        else:
            assert_drained(llm.engine)
    assert runs["write_back"] == runs["off"]
