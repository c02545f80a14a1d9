"""Server-sent events as the gateway relays them: whole events only, never half of one."""
from __future__ import annotations

import json
import re
from typing import AsyncIterator

DONE = b"data: [DONE]"

# `, "token_ids": [...]` as ketch serve writes it (json.dumps: the last key of a choice). It cannot
# match inside a JSON string: there a quote is always escaped, so `,` + spaces + `"` never occurs.
_TOKEN_IDS = re.compile(rb',\s*"token_ids":\s*\[[0-9,\s]*\]')
# the error events ketch serve ends a stream with when its engine process died (its API process
# exits next) or its shutdown deadline cut it: the worker is lost, not the request. `"code": "`
# cannot match inside a JSON string either, and no chunk but an error has a "code".
_ERROR_CODE = b'"code": "'
_WORKER_GONE = (b'engine_unavailable"', b'server_shutdown"')
# the error a continuing worker ends a resumed stream with when it made the regenerated ids
# otherwise than the original (ketch/server/README.md, `regenerate_last`): before any of its text
_DIVERGED = _ERROR_CODE + b'resume_diverged"'


def event_boundary(data: bytes) -> int:
    """Length of the leading part of `data` that is whole SSE events (0: none)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def worker_gone_at(block: bytes) -> int:
    """Where the event saying the worker is going (its engine died, its shutdown deadline) starts
    in a block of whole events; -1: none."""
    at = block.find(_ERROR_CODE)
    while at >= 0:
        if block.startswith(_WORKER_GONE, at + len(_ERROR_CODE)):
            return event_boundary(block[:at])
        at = block.find(_ERROR_CODE, at + 1)
    return -1


def diverged(block: bytes) -> bool:
    """Whether a block of a continuing worker's events says it could not continue the stream
    exactly (`resume_diverged`): its answer is not this stream's rest."""
    return _DIVERGED in block


class EventCutter:
    """Whole events out of a body read in arbitrary pieces: `feed` returns the events completed
    by this piece (b"" if none) and keeps the tail of one not complete yet in `pending`."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        if self.pending:
            data = self.pending + data
        cut = event_boundary(data)
        self.pending = data[cut:]
        return data[:cut]


async def whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body in blocks of whole events, each as soon as its blank line arrived; a tail that
    never completes is dropped (a stream that ends there was cut)."""
    cutter = EventCutter()
    async for chunk in chunks:
        block = cutter.feed(chunk)
        if block:
            yield block


def payloads(block: bytes) -> list[bytes]:
    """The data of each event in a block of whole events (several data lines joined by newlines)."""
    out = []
    for event in block.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if lines:
            out.append(b"\n".join(lines))
    return out


def event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


# what a choice left saying nothing looks like as ketch serve writes it (json.dumps): only a block
# holding one of these is parsed, to be sure (carries_nothing)
_NOTHING = (b'"delta": {}, "logprobs": null, "finish_reason": null',
            b'"text": "", "logprobs": null, "finish_reason": null')


def carries_nothing(chunk: dict) -> bool:
    """A chunk with nothing for a client that did not ask for token ids: its choices have no
    text, delta, logprobs or finish, and it has no usage. ketch serve sends one for each token a
    stop string or an output parser holds back, only to carry the token's id."""
    choices = chunk.get("choices")
    return bool(choices) and not chunk.get("usage") and all(
        isinstance(c, dict) and not c.get("delta") and not c.get("text") and c.get("logprobs") is None
        and c.get("finish_reason") is None for c in choices)


def strip_token_ids(block: bytes) -> bytes:
    """The block without the choices' `token_ids` (the gateway asked for them; the client did not),
    and without the events that leaves with nothing in them (carries_nothing): the client gets the
    events it would get from the worker directly."""
    block = _TOKEN_IDS.sub(b"", block)
    if not any(nothing in block for nothing in _NOTHING):
        return block
    *events, rest = block.split(b"\n\n")  # ketch serve ends its events with a blank line
    return b"".join(e + b"\n\n" for e in events if not _says_nothing(e)) + rest


def _says_nothing(raw_event: bytes) -> bool:
    data = payloads(raw_event)
    try:
        return len(data) == 1 and carries_nothing(json.loads(data[0]))
    except ValueError:  # [DONE], or not JSON: not ours to judge
        return False


def lost_event(url: str, reason: str) -> bytes:
    error = {"error": {"message": f"the worker {url} was lost mid-stream: {reason}", "type": "service_unavailable",
                       "param": None, "code": "worker_lost"}}
    return event(error) + DONE + b"\n\n"
