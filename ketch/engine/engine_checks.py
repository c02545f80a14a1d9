"""The engine's invariants, checked by tests after every step and by the idle-time audit."""
from __future__ import annotations

import itertools
import time
import traceback
from typing import TYPE_CHECKING

from ketch.scheduler.request import RequestState

if TYPE_CHECKING:
    from ketch.engine.engine import Engine


def check_engine_invariants(engine: "Engine") -> None:
    """Requests in a state other than RUNNING hold no pages; the KV manager's shadow count of
    every page's holders (running requests' page tables and locks, the tree) holds; /metrics'
    count agrees; idle, every page is free or evictable."""
    running = set(engine.scheduler.running)  # requests hash by identity
    for req in engine.scheduler.running:
        assert req.state is RequestState.RUNNING, f"{req.rid} is {req.state} in the running list"
    for req in itertools.chain(engine.scheduler.waiting, *engine.requests.values()):
        if req not in running:
            assert not req.page_table and req.cache_node is None, f"{req.rid} ({req.state}) holds pages"
    engine.kv.check_invariants(engine._holders())
    assert engine.stats().kv_page_refs_unaccounted == 0, "/metrics would not show the count above"
    if not engine._holders() and not engine.kv.pins:
        engine.kv.check_idle()
    if engine.spec is not None:
        engine.spec.proposer.check_invariants()  # the draft model's own pool


def audit_if_due(engine: "Engine", interval_s: float) -> None:
    """The idle-time audit (the server calls it when a poll for work came back empty): once per
    interval_s after steps ran, every invariant above, on every tier (idle: free + cached + used
    == total). A failure is logged and counted in /metrics, not raised: the engine keeps serving,
    and the count says a page went astray."""
    now = time.monotonic()
    if engine._steps == engine._audited_at_step or now - engine._audited_at < interval_s:
        return
    engine._audited_at, engine._audited_at_step = now, engine._steps
    engine.audits += 1
    try:
        engine.check_invariants()
    except AssertionError:
        engine.audit_failures += 1
        traceback.print_exc()
