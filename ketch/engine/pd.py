"""The engine's PD glue (issue 17; ketch/disagg/README.md, "For the engine"): what a prefill or a
decode engine does with a request that carries a bootstrap room, beside the usual path.

    prefill: add ─▶ start (sender.init) ─▶ prompt runs ─▶ first token ─▶ send_first (hold pages,
             send, the request finishes) ─▶ outputs(): on Success the token reaches the client,
             finished; on Failed an error
    decode:  add ─▶ start (park at the KV arrival gate) ─▶ outputs(): an arrived request's first
             token is its first output (stop checks as usual) ─▶ it decodes like any other

Functions over the engine rather than a class of their own: the engine owns the requests and
their outputs; pd_prefill.py and kv_arrival_gate.py own the transfers and their pages.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ketch.disagg import KVPoll
from ketch.engine.kv_arrival_gate import POLL_WAIT_S
from ketch.engine.messages import Bootstrap
from ketch.engine.outputs import EngineOutput, TokenLogprob
from ketch.engine.pd_prefill import PageHold
from ketch.scheduler.request import FinishReason, Request

if TYPE_CHECKING:
    from ketch.engine.engine import Engine


def start(engine: Engine, req: Request, bootstrap: Bootstrap) -> bool:
    """Begin the request's transfer; True when it waits at the KV arrival gate (decode). A decode
    engine on the fake backend has no gate (no KV ever comes): it runs the prompt itself."""
    if engine.pd_sends is not None:
        engine.pd_sends.start(req, bootstrap.room)
        return False
    if engine.kv_gate is None:
        return False
    engine.scheduler.park([req], engine.kv_gate, (bootstrap.addr, bootstrap.room))
    return True


def send_first(engine: Engine, req: Request, token: int, logprobs: list[TokenLogprob] | None,
               num_output: int) -> None:
    """Prefill: `req`'s first token is on the host and its prompt's KV in its pages: send both,
    then end the request (its max_len stops it here); its answer waits for the transfer's end."""
    assert engine.pd_sends is not None
    engine.pd_sends.send(req, token, logprobs)
    engine._check_stop(req, token, num_output)


def abort_send(engine: Engine, req: Request) -> None:
    """Prefill: the client is gone. A request whose first token is already out (finished, its
    answer waiting for the transfer) is reported aborted here: its transfer will report nothing."""
    assert engine.pd_sends is not None
    if engine.pd_sends.abort(req, "the request was aborted on the prefill server") and req.is_finished:
        out = engine._output(req, [], None)
        out.finish_reason = FinishReason.ABORT.value
        engine._aborted.append(out)


def outputs(engine: Engine) -> list[EngineOutput]:
    """This step's news from the transport: finished sends (prefill), arrived requests (decode)."""
    out: list[EngineOutput] = []
    if engine.pd_sends is not None:
        for done in engine.pd_sends.poll():
            req = done.req
            if done.error is not None and not req.is_finished:
                engine.scheduler.finish(req, FinishReason.ABORT)  # failed before its first token
            tokens = [] if done.error is not None else [done.token]
            out.append(engine._output(req, tokens, done.logprobs if tokens else None, error=done.error))
            engine._forget(req)
    if engine.kv_gate is not None:
        now, now_mono = time.perf_counter(), time.monotonic()
        for a in engine.kv_gate.take_arrived():
            req = a.req
            req.first_token_at = now
            engine._generated_tokens += 1
            engine._check_stop(req, a.token, 1)
            first = engine._output(req, [a.token], None)
            first.pd_timing = (a.prefill_s, a.transfer_s, a.kv_wait_s, now_mono - a.arrived_at)
            out.append(first)
            if req.is_finished:
                engine._forget(req)
    return out


def idle(engine: Engine, timeout: float) -> None:
    """Nothing to run this step: sleep at the gates, or, on a prefill engine whose only work is
    transfers in flight, a moment before the next poll (the transport has no event to wait on)."""
    if engine.scheduler.has_parked() or engine.pd_sends is None or not engine.pd_sends.has_work():
        engine.scheduler.wait_at_gates(timeout)
    else:
        time.sleep(min(timeout, POLL_WAIT_S))


def stats(engine: Engine) -> dict[str, object]:
    """EngineStats' PD fields: live transfers by state, ended ones by outcome."""
    side = engine.pd_sends if engine.pd_sends is not None else engine.kv_gate
    if side is None:
        return {"pd_enabled": engine.transport is not None}
    states = side.live_states()
    live = tuple(sum(1 for s in states if s == want)
                 for want in (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring))
    early = engine.pd_sends.pages_sent_early if engine.pd_sends is not None else 0
    return {"pd_enabled": True, "pd_live": live, "pd_succeeded": side.succeeded, "pd_failed": side.failed,
            "pd_pages_sent_early": early}


def holds(engine: Engine) -> list[PageHold]:
    """Pages PD transfers hold outside any request (the KV manager's invariants count them)."""
    if engine.pd_sends is not None:
        return engine.pd_sends.holds()
    if engine.kv_gate is not None:
        return engine.kv_gate.holds()
    return []
