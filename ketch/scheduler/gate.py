"""Gates: where a request waits, outside the running and waiting queues, until something it
needs is ready: its grammar compiled (engine/grammar_gate.py), its pages prefetched from storage
(engine/storage_gate.py), its prompt's KV and first token arrived from a prefill server
(engine/kv_arrival_gate.py; the request then comes out holding its pages and runs at once). The loop never blocks on one: each step asks every
gate which groups are ready (or failed), and the scheduler makes the state change.

    add ──park(gate, need)──▶ PENDING ──gate ready──▶ WAITING (RUNNING with its KV) ──▶ ...   (scheduler.open_gates)
                                 └──gate failed──▶ FINISHED (abort, with the gate's error)
                                 └──abort──▶ FINISHED, and the gate forgets the request

A gate only tracks what it waits for; request state is the scheduler's alone.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ketch.scheduler.request import Request


class Gate(Protocol):
    def park(self, samples: list["Request"], need: Any) -> None:
        """Start waiting for `need` on behalf of these samples (of one request)."""

    def release(self) -> list[tuple[list["Request"], Exception | None]]:
        """Groups whose wait has ended since the last call, each with None or the error."""

    def has_parked(self) -> bool: ...

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s until some wait ends (an otherwise idle engine sleeps here)."""

    def forget(self, req: "Request") -> None:
        """`req` was aborted while parked: stop waiting for it."""
