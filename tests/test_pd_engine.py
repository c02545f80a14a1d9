"""PD disaggregation in one process: a prefill engine and a decode engine (tiny random model) on
the real tcp transport over loopback (and mooncake's, where installed), both step loops driven here, against a colocated engine.
Greedy output must match; every page comes back on both sides; failures end requests with an
error and free their pages only once the transfer is over. Overlap scheduling off and on."""
from __future__ import annotations

import importlib.util
import os
import random
import time

import pytest

from conftest import assert_drained, collect, make_tiny_engine
from disagg_peer import wait_until
from ketch.engine import pd
from ketch.disagg.fake import FakeHub
from ketch.engine.messages import Bootstrap
from ketch.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MAX_STEPS = 200_000  # the transport runs beside the loops: steps until the pair is done, bounded

pytestmark = pytest.mark.usefixtures("run_engine_modes")


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def pair(path: str, backend: str = "tcp", timeout: float = 30.0, hub: FakeHub | None = None, **kw):
    common = dict(disaggregation_transfer_backend=backend, disaggregation_timeout=timeout, **kw)
    prefill = make_tiny_engine(path, disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **common)
    decode = make_tiny_engine(path, disaggregation_mode="decode", **common)
    if hub is not None:  # the fake backend pairs rooms through a hub shared in one process
        prefill.close()
        decode.close()
        from ketch.engine.engine import Engine
        prefill = Engine(prefill.config, (), hub)
        decode = Engine(decode.config, (), hub)
    return prefill, decode


def boot(prefill, room: int) -> Bootstrap:
    addr = prefill.transport.bootstrap_addr
    host, _, port = addr.rpartition(":") if addr != "fake" else ("fake", "", "1")
    return Bootstrap(host, int(port), room)


def run_pair(*engines) -> list[list]:
    outs: list[list] = [[] for _ in engines]
    for _ in range(MAX_STEPS):
        if not any(e.has_unfinished() for e in engines):
            return outs
        for e, out in zip(engines, outs):
            if e.has_unfinished():
                out.extend(e.step())
                e.check_invariants()
    raise AssertionError("the pair did not drain")


def test_tcp_greedy_matches_colocated(tiny_config_path):
    greedy_matches_colocated(tiny_config_path, "tcp")


def test_mooncake_greedy_matches_colocated(tiny_config_path):
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    greedy_matches_colocated(tiny_config_path, "mooncake")


def greedy_matches_colocated(tiny_config_path: str, backend: str) -> None:
    prompts = [prompt(5, 1), prompt(12, 2), prompt(33, 3), prompt(16, 4)]  # partial and whole pages
    colocated = make_tiny_engine(tiny_config_path)
    for i, p in enumerate(prompts):
        colocated.add_request(f"r{i}", p, GREEDY)
    want = collect(run_pair(colocated)[0])
    prefill, decode = pair(tiny_config_path, backend)
    try:
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, GREEDY, bootstrap=boot(prefill, 100 + i))
            decode.add_request(f"r{i}", p, GREEDY, bootstrap=boot(prefill, 100 + i))
        raw = run_pair(prefill, decode)
        pre, dec = (collect(o) for o in raw)
        for i in range(len(prompts)):
            assert dec[(f"r{i}", 0)] == want[(f"r{i}", 0)]
            assert pre[(f"r{i}", 0)]["ids"] == want[(f"r{i}", 0)]["ids"][:1]
            assert pre[(f"r{i}", 0)]["reason"] == "length" and pre[(f"r{i}", 0)]["ends"] == 1
        check_ttft_split(raw[0], raw[1], len(prompts))
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def check_ttft_split(prefill_outs: list, decode_outs: list, num_requests: int) -> None:
    """A decode engine's first output of each request carries the TTFT split; nothing else does."""
    split = [o.pd_timing for o in decode_outs if o.pd_timing is not None]
    assert len(split) == num_requests
    assert all(o.pd_timing is None for o in prefill_outs)
    firsts = {}
    for o in decode_outs:
        firsts.setdefault(o.request_id, o)
    assert all(o.pd_timing is not None and o.new_token_ids for o in firsts.values())
    for prefill_s, transfer_s, kv_wait_s, first_decode_s in split:
        # the prefill ran while this side waited at its gate; the transfer is the end of that wait
        assert 0 < prefill_s and 0 <= transfer_s <= kv_wait_s and 0 <= first_decode_s


def test_lone_fake_decode_runs_the_prompt_itself(tiny_config_path):
    """The fake backend across processes: no KV ever comes, so a decode engine on it (no hub)
    computes each prompt and answers exactly as a colocated engine; a lone fake prefill engine's
    one token is the colocated engine's first."""
    prompts = [prompt(5, 1), prompt(33, 3)]
    colocated = make_tiny_engine(tiny_config_path)
    for i, p in enumerate(prompts):
        colocated.add_request(f"r{i}", p, GREEDY)
    want = collect(run_pair(colocated)[0])
    prefill, decode = pair(tiny_config_path, backend="fake")
    try:
        assert decode.kv_gate is None
        for i, p in enumerate(prompts):
            prefill.add_request(f"r{i}", p, GREEDY, bootstrap=boot(prefill, 100 + i))
            decode.add_request(f"r{i}", p, GREEDY, bootstrap=boot(prefill, 100 + i))
        pre, dec = (collect(o) for o in run_pair(prefill, decode))
        for i in range(len(prompts)):
            assert dec[(f"r{i}", 0)] == want[(f"r{i}", 0)]
            assert pre[(f"r{i}", 0)]["ids"] == want[(f"r{i}", 0)]["ids"][:1]
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def test_decode_without_room_queues_until_pages_free(tiny_config_path):
    """Two prompts the decode pool cannot hold at once: the second waits at the gate (its room not
    registered yet; the prefill engine keeps its KV meanwhile) until the first finishes and frees
    its pages, then runs. Both answers equal a colocated engine's; every page comes back."""
    probe = make_tiny_engine(tiny_config_path)
    per_page = 2 * 1024 * 1024 // probe.allocator.num_pages  # the tiny pool's bytes per page
    probe.close()
    common = dict(disaggregation_transfer_backend="tcp", disaggregation_timeout=30.0)
    prefill = make_tiny_engine(tiny_config_path, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                               **common)
    decode = make_tiny_engine(tiny_config_path, disaggregation_mode="decode", kv_cache_memory=per_page * 20, **common)
    # each prompt takes 60 % of the decode pool's pages (whole pages of 4 tokens, then a partial one)
    tokens = decode.allocator.num_pages * 6 // 10 * 4 - 2
    prompts = [prompt(tokens, 21), prompt(tokens, 22)]
    colocated = make_tiny_engine(tiny_config_path)
    for i, p in enumerate(prompts):
        colocated.add_request(f"q{i}", p, GREEDY)
    want = collect(run_pair(colocated)[0])
    try:
        assert 10 <= decode.allocator.num_pages < 40, decode.allocator.num_pages
        for i, p in enumerate(prompts):
            decode.add_request(f"q{i}", p, GREEDY, bootstrap=boot(prefill, 300 + i))
        assert len(decode.kv_gate.parked) == 1 and len(decode.kv_gate.queued) == 1
        for i, p in enumerate(prompts):
            prefill.add_request(f"q{i}", p, GREEDY, bootstrap=boot(prefill, 300 + i))
        pre, dec = (collect(o) for o in run_pair(prefill, decode))
        for i in range(len(prompts)):
            assert dec[(f"q{i}", 0)] == want[(f"q{i}", 0)]
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def test_a_prefill_pool_bounds_the_prompt_not_the_output(tiny_config_path):
    """A prefill engine holds KV for the prompt and its first token only, so a pool smaller than
    prompt + max_tokens (the usual PD layout: the decode side holds the outputs) takes the request,
    and the pair answers as a colocated engine does. It was refused on the prefill side ("prompt +
    max_tokens exceeds the KV cache capacity") though the decode side could serve it. A prompt
    the prefill pool cannot hold with its first token is still refused, naming the prompt."""
    probe = make_tiny_engine(tiny_config_path)
    per_page = 2 * 1024 * 1024 // probe.allocator.num_pages
    probe.close()
    common = dict(disaggregation_transfer_backend="tcp", disaggregation_timeout=30.0)
    prefill = make_tiny_engine(tiny_config_path, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                               kv_cache_memory=per_page * 20, **common)
    decode = make_tiny_engine(tiny_config_path, disaggregation_mode="decode", **common)
    try:
        capacity = prefill.kv.capacity_tokens
        assert decode.kv.capacity_tokens > 2 * capacity
        long_output = SamplingParams(temperature=0.0, max_tokens=capacity, ignore_eos=True)
        p = prompt(capacity // 2, 31)
        colocated = make_tiny_engine(tiny_config_path)
        colocated.add_request("w", p, long_output)
        want = collect(run_pair(colocated)[0])
        colocated.close()
        prefill.add_request("w", p, long_output, bootstrap=boot(prefill, 400))
        decode.add_request("w", p, long_output, bootstrap=boot(prefill, 400))
        pre, dec = (collect(o) for o in run_pair(prefill, decode))
        assert dec[("w", 0)] == want[("w", 0)] and len(dec[("w", 0)]["ids"]) == capacity
        assert pre[("w", 0)]["ids"] == want[("w", 0)]["ids"][:1]
        with pytest.raises(ValueError, match=r"^prompt: .*exceeds the KV cache capacity of this prefill server"):
            prefill.add_request("x", prompt(capacity, 32), GREEDY, bootstrap=boot(prefill, 401))
        prefill.add_request("y", prompt(capacity - 1, 33), GREEDY, bootstrap=boot(prefill, 402))  # + 1 fits
        prefill.abort("y")
        run_pair(prefill)
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def test_decode_waiting_for_room_fails_after_the_timeout(tiny_config_path):
    prefill, decode = pair(tiny_config_path, timeout=0.3)
    try:
        hog = decode.allocator.alloc(decode.allocator.num_free)  # no page left for anyone
        decode.add_request("w", prompt(9, 4), GREEDY, bootstrap=boot(prefill, 400))
        outs: list = []
        deadline = time.monotonic() + 30
        while not any(o.request_id == "w" and o.finished for o in outs):
            assert time.monotonic() < deadline, "the waiting request never failed"
            outs += decode.step()
        (w,) = [o for o in outs if o.request_id == "w"]
        assert w.finish_reason == "abort" and "no room for the prompt's 3 KV pages" in w.error, w.error
        assert not decode.kv_gate.has_parked()
        decode.allocator.decref(hog)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def test_decode_without_prefill_fails_within_timeout_and_frees_pages(tiny_config_path):
    # the timeouts cover the room that must succeed too: 5 s, not less, so that a pause of this
    # process (a garbage collection late in the suite) cannot fail it
    prefill, decode = pair(tiny_config_path, timeout=5.0)
    try:
        decode.add_request("lost", prompt(20), GREEDY, bootstrap=boot(prefill, 7))  # prefill never hears of room 7
        decode.add_request("ok", prompt(9, 5), GREEDY, bootstrap=boot(prefill, 8))
        prefill.add_request("ok", prompt(9, 5), GREEDY, bootstrap=boot(prefill, 8))
        pre, dec = (collect(o) for o in run_pair(prefill, decode))
        assert dec[("lost", 0)]["reason"] == "abort" and dec[("lost", 0)]["ids"] == []
        assert dec[("ok", 0)]["reason"] == "length" and len(dec[("ok", 0)]["ids"]) == 8
        assert_drained(decode)
        assert_drained(prefill)
    finally:
        prefill.close()
        decode.close()


def test_abort_on_either_side_fails_the_other(tiny_config_path):
    prefill, decode = pair(tiny_config_path)
    try:
        p = prompt(40, 9)
        decode.add_request("a", p, GREEDY, bootstrap=boot(prefill, 11))
        first_dec = decode.step()  # parked at the KV arrival gate
        decode.abort("a")
        prefill.add_request("a", p, GREEDY, bootstrap=boot(prefill, 11))
        prefill.add_request("b", prompt(6, 2), GREEDY, bootstrap=boot(prefill, 12))
        first_pre = prefill.step()
        prefill.abort("b")  # its decode half never came: the room just ends
        pre_outs, dec_outs = run_pair(prefill, decode)
        pre, dec = collect(first_pre + pre_outs), collect(first_dec + dec_outs)
        assert dec[("a", 0)]["reason"] == "abort"
        assert pre[("b", 0)]["reason"] == "abort"
        a = [o for o in first_pre + pre_outs if o.request_id == "a"]
        assert len(a) == 1 and a[0].error is not None and "KV transfer failed" in a[0].error and not a[0].new_token_ids
        assert_drained(decode)
        assert_drained(prefill)
    finally:
        prefill.close()
        decode.close()


def test_fake_backend_flow(tiny_config_path):
    """fake moves no bytes (the decode side's KV is whatever its pages held): the flow only."""
    prefill, decode = pair(tiny_config_path, backend="fake", hub=FakeHub())
    try:
        p = prompt(10, 3)
        prefill.add_request("f", p, GREEDY, bootstrap=boot(prefill, 1))
        decode.add_request("f", p, GREEDY, bootstrap=boot(prefill, 1))
        pre, dec = (collect(o) for o in run_pair(prefill, decode))
        assert pre[("f", 0)]["ids"] == dec[("f", 0)]["ids"][:1] and len(dec[("f", 0)]["ids"]) == 8
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()


def test_bootstrap_checked_against_the_mode(tiny_config_path):
    colocated = make_tiny_engine(tiny_config_path)
    with pytest.raises(ValueError, match="^bootstrap_host: this server is not part of a PD pair"):
        colocated.add_request("x", prompt(4), GREEDY, bootstrap=Bootstrap("h", 1, 1))
    prefill, decode = pair(tiny_config_path, backend="fake", hub=FakeHub())
    try:
        for eng in (prefill, decode):
            with pytest.raises(ValueError, match="^bootstrap_host: required"):
                eng.add_request("x", prompt(4), GREEDY)
            with pytest.raises(ValueError, match="^bootstrap_room: an int in"):
                eng.add_request("x", prompt(4), GREEDY, bootstrap=Bootstrap("h", 1, 1 << 63))
            for host in ("a b", "h/x", "tcp://h", ""):  # not a host name or address
                with pytest.raises(ValueError, match="^bootstrap_host: the prefill server's bootstrap host"):
                    eng.add_request("x", prompt(4), GREEDY, bootstrap=Bootstrap(host, 1, 1))
            with pytest.raises(ValueError, match="^n: a PD request has one sample"):
                eng.add_request("x", prompt(4), SamplingParams(n=2), bootstrap=Bootstrap("h", 1, 1))
            assert not eng.requests
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("backend", [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                  reason="the nixl package is not installed")),
    pytest.param("mooncake", marks=pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                                      reason="the Mooncake transfer engine is not installed")),
])
def test_a_long_prompt_moves_its_kv_while_its_later_chunks_run(tiny_config_path, backend):
    """Chunked prefill (8 tokens a step, pages of 4): the first chunk's two pages are on their way
    while the prefill engine has not run the prompt's other chunks yet (the decode side is
    Transferring before the prefill engine steps again); the answer equals a colocated engine's
    and every page comes back on both sides. An abort in the middle of such a transfer ends both."""
    if backend == "nixl":
        os.environ.setdefault("UCX_TLS", "tcp")
    p, q = prompt(41, 7), prompt(30, 8)
    colocated = make_tiny_engine(tiny_config_path, chunked_prefill_size=8)
    colocated.add_request("long", p, GREEDY)
    want = collect(run_pair(colocated)[0])
    prefill, decode = pair(tiny_config_path, backend, chunked_prefill_size=8)
    try:
        for rid, tokens, room in (("long", p, 501), ("cut", q, 502)):
            decode.add_request(rid, tokens, GREEDY, bootstrap=boot(prefill, room))
            prefill.add_request(rid, tokens, GREEDY, bootstrap=boot(prefill, room))
        outs = [decode.step(), prefill.step()]  # decode posts its pages; prefill runs the first chunk only
        long = prefill.pd_sends.sends["long"]
        assert 0 < long.given < len(p) // 4
        # the pages on their way are held by the transfer itself: a preemption or abort of the
        # request must not hand them to another request while the transport may read them
        assert long.hold is not None and long.hold.page_table == long.req.page_table[:long.given]
        assert pd.stats(prefill)["pd_pages_sent_early"] >= long.given  # /metrics' ketch_pd_pages_sent_early
        wait_until(lambda: pd.stats(decode)["pd_live"][2] >= 1, 30, "the decode side to be Transferring")
        prefill.abort("cut")  # its first pages may be moving: both sides end it, no page is lost
        pre_outs, dec_outs = run_pair(prefill, decode)
        dec = collect(outs[0] + dec_outs)
        assert dec[("long", 0)] == want[("long", 0)]
        assert dec[("cut", 0)]["reason"] == "abort" and dec[("cut", 0)]["ids"] == []
        assert_drained(prefill)
        assert_drained(decode)
    finally:
        prefill.close()
        decode.close()
