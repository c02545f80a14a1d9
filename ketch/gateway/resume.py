"""What a broken stream's client has, and the request that continues it elsewhere (issue 16, item 4).

The gateway asks the worker for `return_token_ids` on every resumable stream (n = 1, one prompt),
so each relayed chunk carries the ids of its text (stripped on the way out unless the client asked
for them), and gives the request a seed if it has none, so that sampling is a function of seed and
position on every worker. When the stream breaks, `read_so_far` reads the events the client got:

    [role] chunk[ids] ... chunk[ids]  [B: an output parser's tail]  [final: finish_reason]  ✂
                          └ the last chunk with ids; `after` = choice chunks the client got after it

and `continuation` asks another worker to resume from every id with the last chunk's ids made again
silently (`resume.regenerate_last`, server README): a chat stream sends an event's finish in
chunks of their own, so the gateway cannot tell whether the last ids ended the stream; made again,
they end it again if they did. What the worker then sends first are the `after` chunks the client
already has (its output is deterministic: greedy, or seeded): they are dropped. `Continuation`
rewrites the rest: the original's `id` and `created`, usage plus the ids the worker did not make,
`token_ids` out unless the client asked for them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ketch.gateway.sse import DONE, carries_nothing, event, payloads


@dataclass
class StreamSoFar:
    id: str | None = None  # the original's, kept on every continued chunk
    created: int | None = None
    sent_any: bool = False  # a choice chunk reached the client (the role chunk, an echo)
    ids: list[int] = field(default_factory=list)
    last_ids: int = 0  # ids in the last chunk that had some
    after: int = 0  # choice chunks after that one (a finish in it counts as one)


def read_so_far(blocks: list[bytes]) -> StreamSoFar:
    """The stream as the client has it, from the blocks relayed to it (ids not stripped)."""
    so = StreamSoFar()
    for data in (p for block in blocks for p in payloads(block)):
        if data == DONE[6:]:
            continue
        ev = json.loads(data)
        if so.id is None and "id" in ev:
            so.id, so.created = ev["id"], ev.get("created")
        for choice in ev.get("choices") or ():
            so.sent_any = True
            ids = choice.get("token_ids") or []
            if ids:
                so.ids += ids
                so.last_ids = len(ids)
                so.after = 1 if choice.get("finish_reason") else 0  # completions: ids and finish together
            else:
                so.after += 1
    return so


@dataclass(frozen=True)
class ContinuationPlan:
    body: bytes
    prefilled: int  # ids the worker takes as made (usage adds them)
    drop: int  # leading choice chunks the client already has


def continuation(fields: dict[str, Any], so: StreamSoFar) -> ContinuationPlan:
    """`fields`: the body the original worker got (seed and return_token_ids included)."""
    body = dict(fields)
    if so.ids:
        body["resume"] = {"generated_token_ids": so.ids, "regenerate_last": so.last_ids}
        return ContinuationPlan(json.dumps(body).encode(), len(so.ids) - so.last_ids, so.after)
    if so.sent_any:  # a role chunk or an echo, no token yet: resume from nothing, so none comes again
        body["resume"] = {"generated_token_ids": []}
    return ContinuationPlan(json.dumps(body).encode(), 0, 0)


class Continuation:
    """Rewrites a continuing worker's events for the client: `(kept, sent)` per block, `kept`
    with the ids (for a later failover's `read_so_far`), `sent` as the client gets it."""

    def __init__(self, so: StreamSoFar, plan: ContinuationPlan, strip_ids: bool) -> None:
        self.so, self.plan, self.strip_ids = so, plan, strip_ids
        self.drop = plan.drop

    def __call__(self, block: bytes) -> tuple[bytes, bytes]:
        kept, sent = [], []
        for data in payloads(block):
            if data == DONE[6:]:
                kept.append(DONE + b"\n\n")
                sent.append(DONE + b"\n\n")
                continue
            ev = json.loads(data)
            if ev.get("choices") and self.drop:
                self.drop -= 1  # n = 1: one choice per chunk
                continue
            if self.so.id is not None and "id" in ev:
                ev["id"], ev["created"] = self.so.id, self.so.created
            usage = ev.get("usage")
            if usage:
                usage["completion_tokens"] += self.plan.prefilled
                usage["total_tokens"] += self.plan.prefilled
            kept.append(event(ev))
            if self.strip_ids:
                for choice in ev.get("choices") or ():
                    choice.pop("token_ids", None)
                if not carries_nothing(ev):  # a held-back token's chunk: only its ids were news
                    sent.append(event(ev))
            else:
                sent.append(kept[-1])
        return b"".join(kept), b"".join(sent)
