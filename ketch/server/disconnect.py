"""Non-streaming requests end when their client leaves, as streams do.

A stream notices a gone client when a write fails; a request that answers once at the end
writes nothing until then, so without a watch it would run to `max_tokens` for nobody. Once the
body has been read, the next ASGI `receive()` returns only when the client disconnects: racing
it against the work cancels the work (whose `finally` aborts its samples in the engine).
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but logs do


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or a 499 once the client has gone (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return Response(status_code=CLIENT_CLOSED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
