"""The per-step sampler: logits [B, V] -> one token per row (+ logprobs), batched.

    logits ──► raw logprobs (log_softmax; only when a row wants logprobs)
      │
      ├─► edits: logit_bias, min_tokens bans (one sparse add), penalties, grammar mask   [skipped if none]
      │
      ├─► greedy rows: argmax                  (bit-exact argmax of the input when unedited)
      └─► sampled rows: / temperature ─► top-k ─► top-p ─► softmax ─► min-p ─► draw (inverse CDF at
                                                                   the row's token_uniform(seed, k))

Returned logprobs describe the RAW model distribution (before bias, penalties, temperature
and truncation), as vLLM does by default: they say what the model thought, not how the
token was picked. Nothing here syncs with the device: `DeviceSample.start_copy` queues the
step's single device->host copy behind the sampling kernels, and `HostSample.wait` waits for
that copy alone, so an overlapped loop can queue the next step first and read these ids later.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ketch.sampling.batch import SampledRows, SamplingBatch, SamplingRow
from ketch.sampling.filters import draw_, min_p_, top_k_only_, top_k_top_p_

__all__ = [
    "DeviceSample",
    "HostSample",
    "edit_logits",
    "SampleResult",
    "SamplingBatch",
    "SamplingRow",
    "sample",
    "sample_on_device",
]


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's raw logprob, every row, when any row asked
    top_ids: list[list[int]] | None  # [B][k], k = max top_logprobs in the batch; None if 0
    top_logprobs: list[list[float]] | None  # descending, aligned with top_ids


@dataclass
class HostSample:
    """A step's results on their way to the host; `wait` blocks until they are there."""

    data: torch.Tensor  # token ids [B], or packed [B, 2 + 2k]; pinned host memory on CUDA
    packed: bool
    num_top: int
    copied: torch.cuda.Event | None  # None off CUDA: the data is already there

    def wait(self) -> SampleResult:
        if self.copied is not None:
            self.copied.synchronize()  # this copy only, not the steps queued after it
        if not self.packed:
            return SampleResult(self.data.tolist(), None, None, None)
        rows = self.data.tolist()
        k = self.num_top
        return SampleResult(
            token_ids=[int(r[0]) for r in rows],
            logprobs=[r[1] for r in rows],
            top_ids=[[int(t) for t in r[2 : 2 + k]] for r in rows] if k else None,
            top_logprobs=[r[2 + k :] for r in rows] if k else None,
        )


@dataclass
class DeviceSample:
    """The step's results still on the device; `token_ids` can feed the next step directly."""

    token_ids: torch.Tensor  # [B] int64
    packed: torch.Tensor | None  # [B, 2 + 2k] float64: id, logprob, top ids, top logprobs
    num_top: int

    def start_copy(self) -> HostSample:
        """Queue the one device->host transfer of the step; returns without waiting."""
        src = self.token_ids if self.packed is None else self.packed
        if src.device.type != "cuda":
            return HostSample(src, self.packed is not None, self.num_top, None)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return HostSample(host, self.packed is not None, self.num_top, copied)

    def to_host(self) -> SampleResult:
        return self.start_copy().wait()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    return sample_on_device(logits, batch).to_host()


def sample_on_device(logits: torch.Tensor, batch: SamplingBatch) -> DeviceSample:
    """Sample without syncing. `logits` ([B, V], fp32) is not modified."""
    assert logits.shape == (batch.size, batch.vocab_size), (logits.shape, batch.size)
    logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if batch.num_logprobs >= 0 else None

    logits = edit_logits(logits, batch)

    sampled = batch.sampled
    if sampled is None:
        token_ids = _argmax(logits)
    elif not batch.any_greedy:
        token_ids = _draw(logits, sampled)
    else:
        token_ids = _argmax(logits)
        assert sampled.index is not None
        picked = _draw(logits.index_select(0, sampled.index), sampled)
        token_ids.index_copy_(0, sampled.index, picked)

    if raw_logprobs is None:
        return DeviceSample(token_ids, None, 0)
    packed = _pack_logprobs(raw_logprobs, token_ids, batch.num_logprobs)
    return DeviceSample(token_ids, packed, batch.num_logprobs)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax over each row; on CUDA ketch's two-launch kernel (kernels/argmax.py: torch's
    ran one vocabulary row in a single block), imported there only (the CPU path loads no Triton)."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from ketch.kernels.argmax import argmax_rows
    return argmax_rows(logits)


def edit_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, min_tokens bans, penalties and grammar masks applied to a copy; the input
    itself if none. The mask goes last: no bias or penalty can bring a disallowed token back."""
    if not batch.needs_edits:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)  # view(-1) below
    if batch.edit_index is not None:
        logits.view(-1).index_put_((batch.edit_index,), batch.edit_value, accumulate=True)
    if batch.penalties is not None:
        batch.penalties.apply_(logits)
    if batch.grammar_mask is not None:
        batch.grammar_backend.apply_mask(logits, batch.grammar_mask)
    return logits


def _draw(logits: torch.Tensor, rows: SampledRows) -> torch.Tensor:
    # a new tensor (the filters below work in place), each row's best logit at 0 before the
    # temperature: the softmax is the same, and nothing overflows to inf (huge logits from a
    # penalty, over a temperature as small as MIN_TEMPERATURE), whose softmax would be NaN
    scaled = (logits - logits.amax(dim=-1, keepdim=True)).div_(rows.temperature)
    if rows.top_p is not None:
        top_k_top_p_(scaled, rows.top_k, rows.top_p, rows.max_top_k)
    elif rows.top_k is not None:
        top_k_only_(scaled, rows.top_k, rows.max_top_k)
    probs = scaled.softmax(dim=-1)
    if rows.min_p is not None:
        min_p_(probs, rows.min_p)
    return draw_(probs, rows.uniform)


def _pack_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[B, 2 + 2k] float64 so ids and logprobs cross to the host in one copy (ids < 2**53)."""
    chosen = raw.gather(1, token_ids.unsqueeze(1))
    parts = [token_ids.unsqueeze(1).double(), chosen.double()]
    if k > 0:
        top = raw.topk(k, dim=-1)  # sorted descending
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=1)
