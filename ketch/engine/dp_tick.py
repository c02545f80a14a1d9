"""One tick of DP attention: what rank 0 tells every rank, what each rank does, and what it answers.

    rank 0 (dp_attention.py)                    every rank, rank 0 too (serve_tick)
    Tick(op, adds per rank, aborts per rank) ─▶ broadcast on the control group (gloo)
                                                 "step": add its requests, apply its aborts;
                                                 any rank unfinished? (one all-reduce) ─▶ yes:
                                                 step its engine, and if that ran no forward,
                                                 an idle forward (runner.forward_idle): every
                                                 rank runs exactly one forward per step tick,
                                                 so the MoE layers' collectives always meet
                                                 "stats" / "flush" / "check" / "audit": the
                                                 engine's own answer
    Reply(outputs, unfinished, value) per rank ◀─ gather to rank 0

The control group is gloo on every device (pickled objects; on CUDA the model's group is nccl),
and its collectives run in the same order on every rank because every rank serves every tick.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ketch.engine.outputs import EngineOutput
from ketch.engine.tp_ranks import RANK_WAIT

if TYPE_CHECKING:
    from ketch.engine.engine import Engine

OPS = ("step", "stats", "flush", "check", "audit", "shutdown")


@dataclass
class Tick:
    op: str  # one of OPS
    adds: list[list[tuple]] = field(default_factory=list)  # per rank: add_request's arguments
    aborts: list[list[tuple[str, int | None]]] = field(default_factory=list)  # per rank: abort's

    def __post_init__(self) -> None:
        if self.op not in OPS:  # a typo would otherwise be a tick every rank silently ignores
            raise ValueError(f"tick op must be one of {OPS}, got {self.op!r}")


@dataclass
class Reply:
    outputs: list[EngineOutput]
    unfinished: bool  # the rank's engine has work left after this tick
    value: Any = None  # stats, flush counts, an invariant's failure


class ControlLink:
    """This rank's end of the control group (made right after the model's group, on every rank)."""

    def __init__(self) -> None:
        # a rank waits here for rank 0's next tick however long the server idles (tp_ranks.RANK_WAIT;
        # a group's timeout is its own, not the world's)
        self.group = dist.new_group(backend="gloo", timeout=RANK_WAIT)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def receive(self) -> Tick:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send(self, tick: Tick) -> None:
        dist.broadcast_object_list([tick], src=0, group=self.group)

    def gather(self, reply: Reply) -> list[Reply] | None:
        """Every rank's reply on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(reply, out, dst=0, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def serve_tick(engine: "Engine", tick: Tick, link: ControlLink) -> Reply:
    """This rank's part of `tick` (rank 0 has validated every request it hands out)."""
    if tick.op == "step":
        return _step(engine, tick, link)
    value: Any = None
    if tick.op == "stats":
        value = engine.stats()
    elif tick.op == "flush":
        value = engine.flush_cache()
    elif tick.op == "check":
        try:
            engine.check_invariants()
        except AssertionError as e:
            value = f"DP rank {link.rank}: {e}"
    elif tick.op == "audit":
        engine.audit_if_due()
    return Reply([], engine.has_unfinished(), value)


def _step(engine: "Engine", tick: Tick, link: ControlLink) -> Reply:
    outputs: list[EngineOutput] = []
    for args in tick.adds[link.rank]:
        try:
            engine.add_request(*args)
        except ValueError as e:  # rank 0's checks passed it: only a state this rank alone has
            outputs.append(EngineOutput(request_id=args[0], index=0, new_token_ids=[], new_logprobs=None, finished=True,
                                        finish_reason="abort", error=str(e)))
    for request_id, index in tick.aborts[link.rank]:
        engine.abort(request_id, index)
    if link.any(engine.has_unfinished()):
        before = engine.runner.forwards
        if engine.has_unfinished():
            outputs += engine.step()
        if engine.runner.forwards == before:
            engine.runner.forward_idle()  # nothing scheduled here: join the others' MoE collectives
        if engine.runner.forwards != before + 1:
            raise RuntimeError(f"DP rank {link.rank}: a step ran {engine.runner.forwards - before} forwards, "
                               f"the ranks are out of step")
    return Reply(outputs, engine.has_unfinished())
