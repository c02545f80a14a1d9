"""Server-sent events: one JSON object per `data:` line, then `data: [DONE]`."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from ketch.server.errors import APIError
from ketch.server.generation import Generation


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_stream(gen: Generation, chunks: Callable[[Generation], AsyncIterator[dict]]) -> AsyncIterator[str]:
    """Frame `chunks(gen)` as SSE. A client that goes away closes this generator (or cancels it):
    the `finally` aborts the unfinished samples in the engine."""
    try:
        async for chunk in chunks(gen):
            yield event(chunk)
    except APIError as e:  # headers are sent already: the error travels in the stream
        yield event(e.body())
    finally:
        gen.close()
    yield "data: [DONE]\n\n"


class GenerationStream(StreamingResponse):
    """The SSE response of a generation. Its `finally` closes the generation whatever becomes of
    the connection, also when the client left before the body iterator ever started (then the
    iterator's own `finally` never runs, and its admission slots would never come back)."""

    def __init__(self, gen: Generation, chunks: Callable[[Generation], AsyncIterator[dict]]) -> None:
        super().__init__(sse_stream(gen, chunks), media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.close()
