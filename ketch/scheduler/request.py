"""A request as the scheduler sees it, with an explicit state machine.

    PENDING ──add──▶ WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED
                        ▲                  │
                        └────preempt───────┘       (abort: from any state to FINISHED)

PENDING: known to the engine but not yet schedulable: parked at a gate (scheduler/gate.py)
until what it needs is ready (its grammar compiled).

Only `Scheduler` moves `state`; every transition goes through one of its methods, so a
request ends exactly once and releases its pages exactly once.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ketch.sampling.params import SamplingParams


class RequestState(enum.Enum):
    PENDING = "pending"  # not yet handed to the scheduler (e.g. its grammar compiles)
    WAITING = "waiting"  # queued (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages; prefilling or decoding
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Request:
    rid: str  # engine-wide unique id (one per sample: "<id>" or "<id>#<index>" when n > 1)
    group_id: str  # the id the caller used; shared by the n samples of one prompt
    index: int  # which of the n samples
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # its output token k draws token_uniform(seed, k) (sampling/counter_rng.py)
    eos_ids: tuple[int, ...]
    max_len: int  # prompt + output may not exceed this (context length)
    arrival: int  # admission order for FCFS and preemption priority
    # Generated ids; the last one or two may be placeholders (< 0) for tokens still being
    # sampled on the device (runner/future_tokens.py), counted by num_unresolved.
    output_ids: list[int] = field(default_factory=list)
    num_unresolved: int = 0
    state: RequestState = RequestState.WAITING
    num_computed: int = 0  # tokens whose K/V is in the pool
    page_table: list[int] = field(default_factory=list)  # pages this request holds a reference on
    cache_node: Any = None  # radix node locked by this request (covers its cached prefix)
    num_inserted_pages: int = 0  # full pages already published to the prefix cache
    num_cached_prompt: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: int | str | None = None
    admitted_once: bool = False
    grammar: Any = None  # GrammarMatcher of a constrained sample, set once its grammar compiled
    gate: Any = None  # the Gate it is parked at while PENDING
    first_token_at: float = 0.0  # engine clock when its first output token reached the host
    # Its sampling reads the ids generated so far (grammar state, penalties), so a step that
    # samples it must first wait for the tokens still in flight. Fixed by the params: set once
    # here, not recomputed for every row of every step.
    needs_history: bool = field(init=False)

    def __post_init__(self) -> None:
        self.needs_history = self.params.grammar is not None or self.params.has_penalties

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, lo: int, hi: int) -> list[int]:
        """all_ids[lo:hi] without building all_ids."""
        n = len(self.prompt_ids)
        if hi <= n:
            return self.prompt_ids[lo:hi]
        if lo >= n:
            return self.output_ids[lo - n : hi - n]
        return self.prompt_ids[lo:] + self.output_ids[: hi - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_resolved(self) -> int:
        """Leading tokens whose ids the host knows (all but trailing placeholders)."""
        return self.seq_len - self.num_unresolved

    @property
    def at_length_limit(self) -> bool:
        """Its newest token is its last, whatever that token turns out to be (max_tokens or
        context length): an overlapped scheduler must not run it again."""
        return len(self.output_ids) >= self.params.max_tokens or self.seq_len >= self.max_len

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next sample."""
        return self.seq_len - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED
