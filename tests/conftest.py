"""Shared fixtures: the bundled SmolLM2 GGUF and tiny random models for fast engine tests."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import torch

from ketch.config import EngineConfig
from ketch.engine.engine import Engine
from ketch.sampling.params import SamplingParams
from ketch.weights.source import default_model_path

# The session's own user cache (converted tokenizers, the file L3's default folder), not the
# user's: servers the tests start inherit it.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ketch-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
# Every engine and server of the session takes the bf16 4-bit kernel up to the same step size,
# hence the same rounding: measured, a loaded CI machine picked 8 tokens in one process and 16 in
# the next (int4_crossover.pinned_tokens), and tests that compare greedy text across processes
# (replicas, PD pairs, a restarted server) would then depend on a timing. The crossover's own
# tests (test_int4_crossover.py) take it off.
os.environ.setdefault("KETCH_INT4_CROSSOVER", "8")

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """For a module whose tests build `LLM(num_threads=1)` (tiny models, or ranks sharing a small
    box): that thread count, in place before each test's snapshot below, given back at teardown.
    Use as `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _torch_threads_given_back() -> Iterator[None]:
    """A test that changes torch's global thread count (LLM(num_threads=...) sets it) gives it
    back, or every later test runs with it. Module fixtures that set it are in place before this
    snapshot and restore it at module teardown, after it."""
    before = torch.get_num_threads()
    yield
    after = torch.get_num_threads()
    assert after == before, f"the test left torch at {after} threads (it found {before})"


@pytest.fixture(scope="session")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own fp32 model of the bundled GGUF (its GGUF loader: ~20 s, so loaded once for
    the weight tests and the parity reference; neither changes it)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_config_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(d / "config.json")


# EngineConfig fields every make_tiny_engine call takes unless it passes its own (a module can
# run all its engine tests twice, e.g. with overlap scheduling off and on: run_engine_modes).
ENGINE_DEFAULTS: dict = {}


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def run_engine_modes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Use as `pytestmark = pytest.mark.usefixtures("run_engine_modes")`: every test of the module
    runs with overlap scheduling off, then on."""
    monkeypatch.setitem(ENGINE_DEFAULTS, "overlap_schedule", request.param)
    return request.param


def make_tiny_engine(config_path: str, eos_token_ids: tuple[int, ...] = (), **kw) -> Engine:
    """A 2-layer random Llama; deterministic weights (seed 0), fp32, a small KV pool by default.
    It has no tokenizer, so no EOS unless `eos_token_ids` (TINY_LLAMA's is 2)."""
    for key, value in ENGINE_DEFAULTS.items():
        kw.setdefault(key, value)
    kw.setdefault("kv_cache_memory", 2 * 1024 * 1024)
    kw.setdefault("page_size", 4)
    return Engine(EngineConfig(model=config_path, load_format="dummy", dtype="float32", **kw), eos_token_ids)


def drain(engine: Engine, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outs.extend(engine.step())
        engine.check_invariants()
    assert not engine.has_unfinished(), "engine did not drain"
    return outs


def collect(outs: list) -> dict[tuple[str, int], dict]:
    """Fold step outputs into {(request_id, index): {"ids": [...], "reason": ..., "logprobs": [...]}}."""
    res: dict[tuple[str, int], dict] = {}
    for o in outs:
        r = res.setdefault((o.request_id, o.index), {"ids": [], "reason": None, "logprobs": [], "ends": 0})
        r["ids"].extend(o.new_token_ids)
        if o.new_logprobs:
            r["logprobs"].extend(o.new_logprobs)
        if o.finished:
            r["reason"] = o.finish_reason
            r["ends"] += 1
    return res


def greedy_ids_and_logprobs(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, list]:
    """Run `prompts` greedily to `max_tokens` (ignore_eos); per prompt its ids and chosen-token logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    res = collect(drain(engine))
    return [res[(f"r{i}", 0)]["ids"] for i in range(len(prompts))], \
        [[lp.logprob for lp in res[(f"r{i}", 0)]["logprobs"]] for i in range(len(prompts))]


def assert_drained(engine: Engine) -> None:
    """Nothing is left to run, and every page comes back: after emptying the prefix cache each
    one is free (a reference leaked on a cached page would keep it allocated)."""
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests
    engine.check_invariants()
    total = engine.allocator.num_pages
    assert engine.allocator.num_free + engine.cache.evictable_pages == total
    engine.cache.reset()
    assert engine.cache.cached_pages == 0, "a cached page is still locked"
    assert engine.allocator.num_free == total, f"{total - engine.allocator.num_free} pages still referenced"
    engine.check_invariants()


# ---------------------------------------------------------------- server tests
# A server test module defines a module-scoped `server` fixture ((process, base URL), from
# server_util.running_server); these give it an openai client and the served model's id.
@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's report carries the end of what each server it talked to printed (a 500
    says only "the server logged the details"); after teardown, ended servers' files go."""
    import server_util

    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for command, tail in server_util.log_tails():
            report.sections.append((f"output of {command}", tail))
    if report.when == "teardown":
        server_util.forget_ended_processes()


# NIXL 1.5 (nixl 1.5.1/1.5.2 with nixl-cu12 1.5.1, UCX inside) segfaults while the interpreter
# finalizes once a process has made an agent (`nixl_agent(...)` then a plain exit: rc 139, even
# after `del` and a collection; reproduced 2026-12-02). The tests that make agents in this
# process (tests/test_disagg_nixl.py) pass, and then the run's exit status would be the crash's.
# So, only when NIXL was loaded: exit with the session's own status right after pytest has
# written its summary and every plugin has finished (trylast), skipping the finalizers.
_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import sys

    if "nixl._api" in sys.modules and _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


def _native_isas() -> list[str]:
    """The instruction sets ketch/native can be built for that this CPU runs (the narrower ones too)."""
    from ketch.native import build

    flags = build._cpu_flags()
    out = ["generic"]
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        out.append("avx512vnni")
    return out


@pytest.fixture(params=_native_isas())
def native_isa(request, monkeypatch):
    """Each of ketch/native's builds this CPU runs, in turn (KETCH_NATIVE_ISA, the load cache cleared)."""
    from ketch.native import build

    monkeypatch.setenv("KETCH_NATIVE_ISA", request.param)
    build.load.cache_clear()
    yield request.param
    build.load.cache_clear()
