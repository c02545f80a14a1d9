"""The engine's invariants, checked by tests after every step and by the idle-time audit."""
from __future__ import annotations

import itertools
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
