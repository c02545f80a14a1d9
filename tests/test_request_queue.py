"""The scheduler's waiting queue (scheduler/request_queue.py): admission order, a request put back
at the front, any one removed; and an engine that drops thousands of queued samples at once (a
client that sent them and left) ends each exactly once and keeps serving."""
from __future__ import annotations

import itertools

from conftest import assert_drained, collect, drain, make_tiny_engine
from ketch.sampling.params import SamplingParams
from ketch.scheduler.request import Request
from ketch.scheduler.request_queue import RequestQueue


def _req(i: int) -> Request:
    return Request(rid=f"r{i}", group_id=f"r{i}", index=0, prompt_ids=[1, 2], params=SamplingParams(), seed=i,
                   eos_ids=(), max_len=64, arrival=i)


def test_order_front_insertion_and_removal_from_anywhere():
    reqs = [_req(i) for i in range(6)]
    q = RequestQueue()
    assert not q and len(q) == 0
    for r in reqs[:4]:
        q.append(r)
    q.appendleft(reqs[4])  # a preempted one goes back to the head
    q.remove(reqs[1])
    q.remove(reqs[4])
    q.append(reqs[5])
    assert list(q) == [reqs[0], reqs[2], reqs[3], reqs[5]] and len(q) == 4
    assert reqs[1] not in q and reqs[2] in q
    assert list(itertools.islice(q, 2)) == [reqs[0], reqs[2]]
    q.appendleft(reqs[3])  # already queued: moved to the front, not queued twice
    assert list(q) == [reqs[3], reqs[0], reqs[2], reqs[5]]


def test_thousands_of_queued_samples_aborted_at_once_end_once_each(tiny_config_path):
    eng = make_tiny_engine(tiny_config_path, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=16)
    for i in range(300):  # 4,800 samples, nearly all queued
        eng.add_request(f"g{i}", [5 + i % 50, 7, 9], params)
    assert len(eng.scheduler.waiting) > 4_000
    for i in range(300):
        eng.abort(f"g{i}")
    outs = eng.step()
    ends = collect(outs)
    assert len(ends) == 4_800 and all(e["reason"] == "abort" and e["ends"] == 1 for e in ends.values())
    eng.add_request("after", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(collect(drain(eng))[("after", 0)]["ids"]) == 3
    assert_drained(eng)
