"""The engine's snapshot for /metrics (EngineStats): counters gathered from its parts."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ketch.engine import pd
from ketch.engine.outputs import EngineStats

if TYPE_CHECKING:
    from ketch.engine.engine import Engine


def engine_stats(engine: "Engine") -> EngineStats:
    """A snapshot for /metrics: queue sizes, page accounting and token counters."""
    s, alloc, cache, host = engine.scheduler.stats, engine.allocator, engine.cache, engine.kv.host_stats()
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        kv_pages_total=alloc.num_pages,
        kv_pages_free=alloc.num_free,
        kv_pages_cached=cache.cached_pages,
        kv_pages_evictable=cache.evictable_pages,
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens,
        computed_tokens=s.computed_tokens,
        generated_tokens=engine._generated_tokens,
        preemptions=s.preemptions,
        kv_page_refs=alloc.num_refs,
        kv_page_table_refs=sum(len(r.page_table) for r in engine._holders()),
        steps=engine._steps,
        step_seconds=engine._step_seconds,
        audits=engine.audits,
        audit_failures=engine.audit_failures,
        decode_seconds=engine._decode_seconds,
        decode_intervals=engine._decode_intervals,
        request_tpot_counts=tuple(engine._tpot_counts),
        request_tpot_sum=engine._tpot_sum,
        device_hit_tokens=engine.kv.hits.device_tokens,
        host_hit_tokens=engine.kv.hits.host_tokens,
        kv_host_pages_total=host.pages_total,
        kv_host_pages_free=host.pages_free,
        host_loaded_bytes=host.loaded_bytes,
        host_saved_bytes=host.saved_bytes,
        host_evicted_pages=host.evicted_pages,
        host_dropped_pages=host.dropped_pages,
        host_loaded_seconds=host.loaded_seconds,
        host_saved_seconds=host.saved_seconds,
        host_load_copy_seconds=host.load_copy_seconds,
        host_save_copy_seconds=host.save_copy_seconds,
        **engine.kv.storage_stats(),
        **pd.stats(engine),
        **_spec_stats(engine),
        **_moe_stats(engine),
    )


def _moe_stats(engine: "Engine") -> dict:
    load = engine.runner.expert_load
    if load is None or not engine.config.enable_expert_distribution_metrics:
        return {}  # (the counters run anyway: EPLB plans from them; reading them costs a device sync)
    return dict(moe_layers=load.layer_ids, moe_expert_tokens=tuple(map(tuple, load.totals())))


def _spec_stats(engine: "Engine") -> dict:
    spec = engine.spec
    if spec is None:
        return {}
    st = spec.stats
    return dict(spec_algorithm=spec.proposer.name, spec_proposed_tokens=st.proposed_tokens,
                spec_accepted_tokens=st.accepted_tokens, spec_verifies=st.verifies,
                spec_accept_counts=tuple(st.accept_counts), spec_plain_steps=spec.cost.plain_steps)
