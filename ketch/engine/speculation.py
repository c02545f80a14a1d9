"""The engine's side of speculative decoding (ketch/spec/README.md): drafts before a step, the
sampling rows of a verify, and the bookkeeping of what a verify step yielded.

    _step:  in-flight verify step processed ─▶ cost model: speculate at this batch size?
            ─▶ yes: every decoding request whose ids are all known gets a draft (proposer; a
               grammar cuts it at the first token it rejects and fills each row's mask)
            ─▶ scheduler: the request's chunk is its last token + the draft (within the budget)
            ─▶ launch: k + 1 sampling rows, row j sees the output + d_0..d_j-1 (penalties,
               min_tokens, the draw's counter) ─▶ process: the rows up to the first disagreement
               are output (spec/verify.py), their K/V stays; the rejected drafts' K/V is never
               counted as computed, so it is rewritten by the tokens that really come there

A verify step is processed before the next step is scheduled, also under overlap: the next
drafts depend on what this one accepted. While the cost model says speculation does not pay,
steps are plain and overlap as usual.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ketch.config import EngineConfig
from ketch.sampling.grammar.base import GrammarBackend, GrammarMatcher
from ketch.sampling.sampler import SamplingRow
from ketch.scheduler.request import Request
from ketch.spec.cost_model import AlwaysSpeculate, SpecCostModel
from ketch.spec.proposer import DraftInput, Proposer
from ketch.spec.stats import SpecStats
from ketch.spec.verify_schedule import VerifyCost


class FixedMask(GrammarMatcher):
    """A grammar row already walked to a draft position: fill_mask copies its precomputed row."""

    def __init__(self, backend: GrammarBackend, row: torch.Tensor) -> None:
        self.backend, self._row = backend, row

    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        mask[row].copy_(self._row)

    def accept(self, token: int) -> bool:  # pragma: no cover - only masks are read from it
        raise NotImplementedError

    def is_terminated(self) -> bool:  # pragma: no cover
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:  # pragma: no cover
        raise NotImplementedError


def grammar_draft(matcher: GrammarMatcher, draft: list[int]) -> tuple[list[int], torch.Tensor]:
    """The draft cut before the first token the grammar rejects (or one that would end it: its
    row after would have no mask), and the mask of each of its len + 1 rows; the matcher ends
    where it began."""
    mask = matcher.backend.allocate_mask(len(draft) + 1)
    walked = 0
    for j, token in enumerate(draft):
        matcher.fill_mask(mask, j)
        if not matcher.accept(token):
            break
        walked += 1
        if matcher.is_terminated():
            walked -= 1
            matcher.rollback(1)
            break
    else:
        matcher.fill_mask(mask, len(draft))
    matcher.rollback(walked)
    if walked < len(draft):  # row `walked` was filled before its token was tried
        draft = draft[:walked]
    return draft, mask[: len(draft) + 1]


class Speculation:
    def __init__(self, config: EngineConfig, proposer: Proposer, verify_cost: VerifyCost) -> None:
        """verify_cost: seconds per decode step by rows, measured here (`block` schedules from it)."""
        self.k = config.speculative_num_draft_tokens
        self.proposer = proposer
        self.needs_hidden = proposer.name == "block"  # the engine keeps each request's last hidden state
        self.cost = SpecCostModel() if config.speculative_adaptive else AlwaysSpeculate()
        self.verify_cost = verify_cost
        self.stats = SpecStats(self.k)
        self._proposed = False  # the step about to launch asked for drafts
        self._last_launch: tuple[float, int] | None = None  # the previous decode step: launch time, rows

    # ------------------------------------------------------------ before the step
    def wants_drafts(self, running: list[Request]) -> bool:
        for req in running:
            req.draft_ids = []
        return bool(running) and self.cost.should_speculate(len(running))

    def propose(self, running: list[Request]) -> None:
        self._proposed = True
        reqs, inputs = [], []
        for req in running:
            room = min(req.params.max_tokens - len(req.output_ids), req.max_len - req.seq_len) - 1
            if req.num_pending != 1 or req.num_unresolved or room < 1:
                continue  # prefilling, ids in flight, or no token to spare after this one
            reqs.append(req)
            inputs.append(DraftInput(np.asarray(req.all_ids, dtype=np.int64), room, req.last_hidden))
        for req, draft in zip(reqs, self.proposer.propose(inputs)):
            if draft and req.grammar is not None:
                draft, req.draft_masks = grammar_draft(req.grammar, draft)
            req.draft_ids = draft

    # ------------------------------------------------------------ the step's rows
    @staticmethod
    def rows(req: Request, draft: list[int]) -> list[SamplingRow]:
        """The k + 1 rows of a verified request: row j samples output number len(output) + j. A row
        samples as a plain row there would, with that output index's number (greedy: the argmax),
        and the host keeps d_j only if the row drew it: whether and how far a step speculated
        changes no token of a seeded sample, and a kept draft is one with p(d_j) (lossless)."""
        out, n = req.output_ids, len(req.output_ids)
        rows = []
        for j in range(len(draft) + 1):
            grammar = req.grammar if req.grammar is None else FixedMask(req.grammar.backend, req.draft_masks[j])
            history = out if j == 0 else [*out, *draft[:j]]
            rows.append(SamplingRow(req.params, req.seed, history, req.prompt_ids, n + j, req.eos_ids, grammar))
        return rows

    # ------------------------------------------------------------ cost model
    def launched(self, batch_size: int, rows: int, decode_only: bool, verify: bool) -> None:
        """A step of `rows` rows was launched. One that asked for drafts counts as speculating even
        if none came: it gave up overlap for them. A plain step's tokens are known now; a verify's
        when processed. The previous decode step's cost is this launch's time since its launch."""
        now = time.perf_counter()
        if self._last_launch is not None:
            self.verify_cost.record(self._last_launch[1], now - self._last_launch[0])
        self._last_launch = (now, rows) if decode_only else None
        self.cost.launched(now, batch_size, decode_only, self._proposed)
        if not verify:
            self.cost.yielded(batch_size)
        self._proposed = False

    def idle(self) -> None:
        """No step this time: the wait must not count as a step's cost."""
        self._last_launch = None
        self.cost.idle()

    def yielded(self, proposed: int, kept_rows: int) -> None:
        """One sequence of the verify step just processed: `kept_rows` tokens out of its drafts."""
        if proposed:
            self.stats.count(proposed, kept_rows - 1)
        self.cost.yielded(kept_rows)
