"""What the engine reports: token deltas per sample after a step (logprobs when asked), and stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class EngineOutput:
    request_id: str
    index: int  # which of the n samples
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # the request failed (e.g. its grammar did not compile); a ValueError's text
    # A PD decode engine's first output: the TTFT split in seconds (prefill on the prefill server,
    # transfer, wait at the KV arrival gate, KV arrival -> this output); -1: not measured
    pd_timing: tuple[float, float, float, float] | None = None


class EngineStats(msgspec.Struct, frozen=True):
    """Engine state for /metrics (a msgspec struct: it travels inside the Pong message as is).

    Pages: free + evictable + in_use == total, where in_use are pages a running request holds
    (cached pages that a request has locked count as in use). References: the tree holds one on
    each cached page and a running request one per page-table entry, so
    `kv_page_refs_unaccounted` is 0 at all times; a leaked reference makes it positive even
    when the page it pins looks evictable (which the page counts cannot show).
    """

    num_running: int
    num_waiting: int
    kv_pages_total: int
    kv_pages_free: int
    kv_pages_cached: int  # in the prefix cache (locked by a request or not)
    kv_pages_evictable: int  # cached and held by no request
    prompt_tokens: int  # prompt tokens of admitted requests
    cached_prompt_tokens: int  # of which the prefix cache served
    computed_tokens: int  # tokens run through the model, recomputation included
    generated_tokens: int
    preemptions: int
    kv_page_refs: int  # references on KV pages, all holders together (a shared page counts per holder)
    kv_page_table_refs: int  # of which running sequences hold: one per page-table entry
    # Engine steps run and the wall time spent in them (launch, and the wait for the step in
    # flight): a client compares its inter-token latency with the mean step under the same load.
    steps: int = 0
    step_seconds: float = 0.0
    # Idle-time audits of every tier's page accounting, and how many found it broken (0 always)
    audits: int = 0
    audit_failures: int = 0
    # Finished requests' time from their first to their last token in the engine, and the token
    # intervals in it: their ratio is the engine-side TPOT (the steps a decoding request saw).
    decode_seconds: float = 0.0
    decode_intervals: int = 0
    # The same per finished request (seconds / intervals), as counts per TPOT_BUCKETS bucket (the
    # last: above them) and their sum: the engine-side TPOT distribution, for its median.
    request_tpot_counts: tuple[int, ...] = ()
    request_tpot_sum: float = 0.0
    # Prefix-cache hits by the tier that served them, and the host tier (L2; all 0 when it is off)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    kv_host_pages_total: int = 0
    kv_host_pages_free: int = 0
    host_loaded_bytes: int = 0  # host -> device
    host_saved_bytes: int = 0  # device -> host
    host_evicted_pages: int = 0  # host LRU evictions
    host_dropped_pages: int = 0  # device evictions with no host copy
    host_loaded_seconds: float = 0.0  # host time in loads (the copies on the CPU; CUDA: queueing only)
    host_saved_seconds: float = 0.0
    host_load_copy_seconds: float = 0.0  # the loads' copy time (CUDA: measured on the copy stream)
    host_save_copy_seconds: float = 0.0  # the saves' copy time (CUDA: measured on the copy stream)
    # The storage tier (L3; all 0 when it is off): cache/storage_tier.py's counters
    storage_enabled: bool = False
    storage_hit_tokens: int = 0  # prompt tokens read from L3 for admitted requests
    storage_read_bytes: int = 0
    storage_written_bytes: int = 0
    storage_written_pages: int = 0
    storage_read_seconds: float = 0.0  # get + decode of the pages read: read_bytes over it is GB/s
    storage_write_seconds: float = 0.0  # encode + set
    storage_dropped_writes: int = 0  # queue full or refused by the store
    storage_rejected_corrupt: int = 0  # failed the checksum or structure checks
    storage_rejected_foreign: int = 0  # another model / dtype / page size / layout / rank
    storage_errors: int = 0  # failed requests to a store server (a dead Redis, ...)
    storage_read_errors: int = 0  # reads that failed for another reason than a missing key
    storage_stale_temps_removed: int = 0  # file store: temps of dead writers swept (file_temps.py)
    storage_prefetches: int = 0
    storage_prefetch_timeouts: int = 0
    storage_prefetch_wait_seconds: float = 0.0
    # PD disaggregation (engine/pd.py; all 0 on a colocated server): live transfers by state
    # (Bootstrapping, WaitingForInput, Transferring) and the ended ones by outcome
    pd_enabled: bool = False
    pd_live: tuple[int, int, int] = (0, 0, 0)
    pd_succeeded: int = 0
    pd_failed: int = 0
    pd_pages_sent_early: int = 0  # prefill: pages handed to the transport while their prompt still ran
    # Speculative decoding (engine/speculation.py; "" and 0 when off): draft tokens verified and
    # kept, sequences verified, how many kept 0..k drafts, and decode steps the cost model ran plain
    spec_algorithm: str = ""
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifies: int = 0
    spec_accept_counts: tuple[int, ...] = ()
    spec_plain_steps: int = 0
    # MoE models (empty otherwise): per sparse layer (its decoder layer index), the (token, pick)s
    # routed to each expert since start-up; under CUDA graphs a decode graph's padding rows count too
    moe_layers: tuple[int, ...] = ()
    moe_expert_tokens: tuple[tuple[int, ...], ...] = ()

    @property
    def kv_pages_in_use(self) -> int:
        return self.kv_pages_total - self.kv_pages_free - self.kv_pages_evictable

    @property
    def kv_page_refs_unaccounted(self) -> int:
        """References that neither the prefix cache (one per cached page) nor a running
        sequence's page table accounts for: 0 unless a reference leaked (or one is missing: < 0)."""
        return self.kv_page_refs - self.kv_pages_cached - self.kv_page_table_refs
