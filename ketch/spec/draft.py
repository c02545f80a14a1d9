"""`draft`: a smaller model with the same tokenizer guesses the next k tokens, greedily.

It has its own runner, KV pool and prefix cache (page size 1, so every token it has run stays
cached and nothing is recomputed for a partial page). Proposing holds no state between steps:

    per sequence:  match its tokens in the draft's radix tree (what it ran before: the prompt,
                   the tokens since) ─▶ admit a holder with room for the drafts
    catch-up:      one batched forward over every sequence's uncached tokens (the verify's kept
                   tokens, usually, as decode rows; a new prompt as an extend, in chunks of
                   CATCH_UP_TOKENS) ─▶ d_0 = argmax
    k - 1 decodes: d_j = argmax after d_{j-1}, batched over the sequences still drafting
    release:       every token the draft model ran is published, drafts included: a page's
                   K/V is a function of the tokens before it, whether or not the target keeps
                   them, so the next step's match finds the accepted drafts already run and the
                   catch-up is only what the draft never ran (the last draft, the target's own
                   token); a rejected branch is an unlocked leaf, evicted (LRU) when room is short

A sequence the draft pool cannot admit gets no draft this step (the target decodes it plainly),
nor does one that has outgrown the draft model's context (`max_len`, its max_position_embeddings
when shorter than the target's): it gets only the drafts whose positions the draft still has.
Greedy drafts are point guesses (q = 1 at d), which the verify's accept rule assumes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ketch.cache.manager import KVCacheManager
from ketch.forward_batch import ForwardBatch, SeqChunk
from ketch.runner.model_runner import ModelRunner
from ketch.spec.proposer import DraftInput

CATCH_UP_TOKENS = 2048  # most tokens one catch-up forward runs (a new long prompt takes several)
DECODE_ROWS = 4  # a chunk of up to this many tokens runs as decode rows (_run)


@dataclass(eq=False)
class _Holder:
    """One sequence's pages in the draft pool for one propose call (KVCacheManager's PageHolder)."""

    ids: list[int]  # the sequence's real tokens, then its drafts as they come
    real: int  # how many of ids are real: the catch-up runs up to there, the decodes past it
    page_table: list[int] = field(default_factory=list)
    cache_node: object = None
    num_computed: int = 0
    num_inserted_pages: int = 0
    draft: list[int] = field(default_factory=list)
    want: int = 0

    @property
    def num_resolved(self) -> int:
        return len(self.ids)  # every id is known (drafts too): publish what has run

    def tokens(self, lo: int, hi: int) -> list[int]:
        return self.ids[lo:hi]


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, num_draft_tokens: int, max_len: int) -> None:
        self.runner, self.kv, self.k, self.max_len = runner, kv, num_draft_tokens, max_len

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftInput]) -> list[list[int]]:
        holders: list[_Holder | None] = [self._admit(x) for x in batch]
        live = [h for h in holders if h is not None]
        try:
            self._catch_up(live)
            for _ in range(1, self.k):
                more = [h for h in live if len(h.draft) < h.want]
                if not more:
                    break
                self._decode(more)
        finally:
            for h in live:
                self.kv.release(h)  # publishes every token that ran (num_computed)
        return [h.draft if h is not None else [] for h in holders]

    def check_invariants(self) -> None:
        self.kv.check_invariants([])  # no holder outlives a propose call
        self.kv.check_idle()

    def _admit(self, x: DraftInput) -> _Holder | None:
        ids = x.token_ids.tolist()
        # the last decode runs d_{want-2} at position len(ids) + want - 2: inside the draft's context
        want = min(self.k, x.max_draft, self.max_len - len(ids) + 1)
        if want < 1:
            return None
        h = _Holder(ids, len(ids), want=want)
        hit = self.kv.match(ids[:-1])
        if not self.kv.admit(h, hit, len(ids) + want - 1):  # the drafts but the last need K/V slots
            return None
        h.num_computed = hit.length
        return h

    def _catch_up(self, holders: list[_Holder]) -> None:
        """Run every holder's uncached real tokens; the forward that reaches the end samples d_0."""
        pending = list(holders)
        while pending:
            budget, chunks = CATCH_UP_TOKENS, []
            for h in pending:
                n = min(h.real - h.num_computed, budget)
                if n == 0:
                    break
                chunks.append((h, n))
                budget -= n
            self._run(chunks)
            pending = [h for h in pending if h.num_computed < h.real]

    def _decode(self, holders: list[_Holder]) -> None:
        self._run([(h, 1) for h in holders])

    def _run(self, chunks: list[tuple[_Holder, int]]) -> None:
        """One draft forward; a chunk that reaches its holder's end appends the argmax of its last
        row to its draft. A chunk of up to DECODE_ROWS tokens (the usual catch-up: the last draft
        and the target's own token) runs as that many decode rows, row j at position start + j
        over the holder's pages, as a verify's rows do: the step stays a decode step (the CPU's
        in-place decode attention, the GPU's decode graphs) instead of an extend that gathers the
        context (on the CPU it timed the same as the extend; the 2-token forward's extra cost was
        the LM head's GEMM, since replaced). Every row of a decode step is sampled; only each
        chunk's last one is read."""
        rowwise = [(h, n) for h, n in chunks if n <= DECODE_ROWS]
        longer = [(h, n) for h, n in chunks if n > DECODE_ROWS]  # after the decode rows, as ForwardBatch wants
        seqs, ids, rows, picks, sampled = [], [], [], [], []
        for h, n in rowwise + longer:
            start, ends = h.num_computed, h.num_computed + n == len(h.ids)
            if n <= DECODE_ROWS:
                seqs.extend(SeqChunk(start + j, 1, h.page_table) for j in range(n))
                rows.extend(range(len(ids), len(ids) + n))
            else:
                seqs.append(SeqChunk(start, n, h.page_table))
                if ends:
                    rows.append(len(ids) + n - 1)
            ids.extend(h.ids[start:start + n])
            if ends:
                picks.append(len(rows) - 1)
                sampled.append(h)
        logits = self.runner.forward(ForwardBatch.build(seqs, self.kv.page_size, ids, rows))
        for h, n in chunks:
            h.num_computed += n
        for h, token in zip(sampled, logits[picks].argmax(dim=-1).tolist()):
            h.draft.append(token)
            h.ids.append(token)
