"""EPLB at run time: the experts' measured load and their re-placement.

    ExpertLoad(routers, num_experts,    per-layer, per-expert counters of routed (token, pick)s:
               layer_ids)               the Router's routing kernel adds its picks (atomics in
                                        its one launch) where it can, else a forward hook adds
                                        its ids (scatter_add_) into a [layers, experts] int64
                                        buffer on the model's device: no host sync. `totals()` only grows
                                        (/metrics); `snapshot()` is the planner's window since
                                        its last `reset()`; `count_rows(n)`: the runner's padded
                                        decode graphs count their first n rows only, their
                                        warm-ups none
    Eplb(layers, load, parallel)        every `parallel.ep.eplb_interval` forwards (`step()`, run
                                        by every rank after the same forward): the load (summed
                                        over ranks when each rank routed only its own tokens),
                                        DeepSeek's planner (eplb.py, one node: the global policy)
                                        over all physical slots, then `move_experts` per layer
    move_experts(experts, phy2log)      every rank's slots get their new expert's weights from a
                                        slot that holds it now (one on the same rank when there
                                        is one, else the lowest-numbered), in one
                                        all_to_all_single of [w13 | w2] rows; then the maps
Every rank computes the same plan from the same load, so no placement is ever sent.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ketch.layers.eplb import rebalance_experts
from ketch.layers.moe_ep import EPExperts, ExpertParallelMoE
from ketch.parallel import ParallelContext
from ketch.parallel.collectives import all_to_all_rows

ALL_ROWS = 1 << 62  # ExpertLoad.rows when every row of a step counts


class ExpertLoad(nn.Module):
    def __init__(self, routers: list[nn.Module], num_experts: int, layer_ids: list[int]) -> None:
        """layer_ids: the decoder layer of each router (the rows' labels on /metrics)."""
        super().__init__()
        if len(layer_ids) != len(routers):
            raise ValueError(f"layer_ids: {len(layer_ids)} for {len(routers)} routers")
        self.layer_ids = tuple(layer_ids)
        # routers whose picks end in always-picked slots (shared experts, ids num_experts..):
        # counted in columns past the experts' (one scatter, no slicing copy) and left out
        self.num_experts = num_experts
        width = num_experts + max((getattr(r, "appended", 0) for r in routers), default=0)
        self.register_buffer("counts", torch.zeros(len(routers), width, dtype=torch.int64), persistent=False)
        self.register_buffer("window_start", torch.zeros_like(self.counts), persistent=False)
        # how many leading rows of a step are traffic (count_rows): a padded decode graph's rows
        # past its batch, and a graph's warm-up forwards, route and must not count
        self.register_buffer("rows", torch.full((1,), ALL_ROWS, dtype=torch.int64), persistent=False)
        self._rows_value = ALL_ROWS  # host copy of `rows`: a fill only when it changes
        self.ones = torch.ones(0, dtype=torch.int64)  # _ones' storage (not a buffer: not moved, never saved)
        for i, router in enumerate(routers):
            if getattr(router, "select_counts_picks", lambda: False)():
                router.count_into = partial(self._row, i)  # the routing kernel adds its picks: no launch
                router.count_rows = self._rows
            else:
                router.register_forward_hook(self._hook(i))

    def count_rows(self, n: int | None) -> None:
        """Count only the first n rows of the forwards from now on (0: none, a graph's warm-up);
        None: every row (eager steps). A fill only when the value changes (stream-ordered: a graph
        replayed before it still reads the old value). Runs outside graphs and compiled code."""
        value = ALL_ROWS if n is None else n
        if value != self._rows_value:
            self.rows.fill_(value)
            self._rows_value = value

    @property
    def masking(self) -> bool:
        """Whether `rows` may cut the steps (the runner's padded forwards): the hook masks then."""
        return self._rows_value != ALL_ROWS

    def _row(self, layer: int) -> torch.Tensor:
        return self.counts[layer]  # looked up per call: the buffer is replaced when the model moves

    def _rows(self) -> torch.Tensor:
        return self.rows

    def _hook(self, layer: int):
        def count(module: nn.Module, args: object, out: tuple[torch.Tensor, torch.Tensor]) -> None:
            ids = out[1]
            ones = self._ones(ids.reshape(-1))
            if self.masking:  # a padded step: its rows past `rows` add nothing
                real = torch.arange(ids.shape[0], device=ids.device) < self.rows
                ones = (ones.view(ids.shape) * real[:, None]).reshape(-1)
            self.counts[layer].scatter_add_(0, ids.reshape(-1), ones)
        return count

    def _ones(self, ids: torch.Tensor) -> torch.Tensor:
        """A view of ones for the scatter (a fill kernel per MoE layer and step was ~1 % of a bs1
        decode step on the H200); grown when a step routes more rows than any before."""
        if self.ones.numel() < ids.numel() or self.ones.device != ids.device:
            self.ones = torch.ones(max(ids.numel(), 2 * self.ones.numel()), dtype=self.counts.dtype, device=ids.device)
        return self.ones[: ids.numel()]

    def snapshot(self) -> torch.Tensor:
        """[MoE layers, experts]: (token, pick)s routed to each expert since the last reset."""
        return (self.counts - self.window_start)[:, : self.num_experts]

    def reset(self) -> None:
        self.window_start.copy_(self.counts)

    def totals(self) -> list[list[int]]:
        """[MoE layers][experts]: every (token, pick) routed since the model was built (one host
        copy: read when /metrics asks, never per step)."""
        return self.counts[:, : self.num_experts].tolist()


def _sources(old: list[int], new: list[int], per_rank: int) -> list[int]:
    """For each new slot, the old slot its weights come from."""
    out = []
    for slot, expert in enumerate(new):
        holders = [i for i, e in enumerate(old) if e == expert]
        if not holders:
            raise ValueError(f"placement: expert {expert} is in no slot now")
        local = [i for i in holders if i // per_rank == slot // per_rank]
        out.append((local or holders)[0])
    return out


@torch.no_grad()
def move_experts(experts: EPExperts, phy2log: torch.Tensor) -> None:
    """Re-place `experts` to `phy2log` (identical on every rank), moving weights between ranks."""
    p, per = experts.parallel, experts.local_slots
    old, new = experts.phy2log.tolist(), phy2log.tolist()
    src = _sources(old, new, per)
    me = p.rank
    outgoing = sorted((j // per, j) for j in range(len(new)) if src[j] // per == me)  # by destination
    incoming = sorted((src[j] // per, j) for j in range(me * per, (me + 1) * per))  # by source
    send = [sum(1 for d, _ in outgoing if d == r) for r in range(p.world_size)]
    recv = [sum(1 for s, _ in incoming if s == r) for r in range(p.world_size)]
    w13, w2 = experts.w13.data, experts.w2.data
    rows = torch.tensor([src[j] - me * per for _, j in outgoing], dtype=torch.int64, device=w13.device)
    buf = torch.cat((w13[rows].flatten(1), w2[rows].flatten(1)), dim=1)
    got = all_to_all_rows(p, buf, send, recv)
    n13 = w13[0].numel()
    new13, new2 = torch.empty_like(w13), torch.empty_like(w2)
    for row, (_, j) in zip(got, incoming, strict=True):
        new13[j - me * per] = row[:n13].view_as(w13[0])
        new2[j - me * per] = row[n13:].view_as(w2[0])
    w13.copy_(new13)
    w2.copy_(new2)
    experts.set_maps(phy2log)


class Eplb:
    def __init__(self, layers: list[ExpertParallelMoE], load: ExpertLoad, parallel: ParallelContext) -> None:
        self.layers, self.load, self.parallel = layers, load, parallel
        self.interval = parallel.ep.eplb_interval
        self.steps = 0
        self.rebalances = 0

    def step(self) -> None:
        """One forward done (on every rank); re-place the experts when the interval is up. A
        forward being captured into a CUDA graph is not a step (nothing ran)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        load = self.load.snapshot()
        if self.layers and self.layers[0].load_is_partial:
            self.parallel.all_reduce(load)
        experts = [layer.experts for layer in self.layers]
        slots = experts[0].local_slots * self.parallel.world_size
        phy2log, _, _ = rebalance_experts(load, slots, num_groups=1, num_nodes=1, num_gpus=self.parallel.world_size)
        for e, placement in zip(experts, phy2log, strict=True):
            move_experts(e, placement)
        self.load.reset()
        self.rebalances += 1
