"""A request's grammar is built and checked off the API process's event loop (server/structured.py
off_the_loop): a schema that takes seconds to build must not stall every other request, stream
and /health probe; one that takes longer than GRAMMAR_CHECK_S is a 400 naming the field."""
from __future__ import annotations

import asyncio
import threading

import pytest

from ketch.server import structured
from ketch.server.errors import APIError

SCHEMA_FIELDS = {"response_format": {"type": "json_object"}}


def test_the_check_runs_while_the_loop_serves_others():
    """prepare() waits for an event that only a coroutine on the loop sets: it returns True only
    if the loop ran that coroutine while prepare() was running (on the loop it would block it)."""
    released = threading.Event()

    async def scenario() -> bool:
        async def other_client() -> None:
            released.set()

        task = asyncio.ensure_future(other_client())
        ran = await structured.off_the_loop(SCHEMA_FIELDS, lambda: released.wait(30.0))
        await task
        return ran

    assert asyncio.run(scenario()) is True


def test_a_request_without_grammars_is_prepared_in_place():
    assert asyncio.run(structured.off_the_loop({"messages": []}, threading.current_thread)) is threading.main_thread()


def test_a_check_over_the_time_limit_is_a_400_naming_the_field(monkeypatch):
    monkeypatch.setattr(structured, "GRAMMAR_CHECK_S", 0.05)
    done = threading.Event()
    try:
        with pytest.raises(APIError) as info:
            asyncio.run(structured.off_the_loop({"regex": "a+"}, lambda: done.wait(30.0)))
    finally:
        done.set()  # the check thread goes back to the pool
    assert info.value.status == 400 and info.value.param == "regex" and "took over 0.05 s" in str(info.value)
