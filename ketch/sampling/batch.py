"""SamplingRow (one request, one step) and SamplingBatch (the step's tensors).

All per-request Python work of a step happens here, once, in one pass over the rows; it
also decides which stages run at all, so `sample` never branches per row. Host->device
copies are few and packed: two for the sparse logit edits, two for the sampled rows' knobs
(their random numbers among them), two for penalties, each only when some row needs it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ketch.sampling.counter_rng import fresh_seed, token_uniform
from ketch.sampling.filters import TOP_P_OFF
from ketch.sampling.grammar.base import GrammarBackend, GrammarMatcher
from ketch.sampling.params import SamplingParams
from ketch.sampling.penalties import Penalties
from ketch.host_copy import to_device

# Dividing fp32 logits by a smaller temperature can overflow to inf (and inf - inf = NaN in
# softmax). Rows this cold are effectively greedy anyway.
MIN_TEMPERATURE = 1e-6


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request for one step."""

    params: SamplingParams
    # The sample's seed: its token number k draws token_uniform(seed, k) (counter_rng.py), so
    # the draw depends on nothing but the seed and the token's place in the output. The engine
    # gives every sample one (fresh OS randomness when the request brought none); None here
    # draws fresh OS randomness for this one token.
    seed: int | None = None
    # Read only for rows with penalties. An int64 np.ndarray is the fast form (no per-token
    # Python work): keep the prompt as one, made once per request.
    output_ids: Sequence[int] | np.ndarray = ()  # generated so far
    prompt_ids: Sequence[int] | np.ndarray = ()  # repetition penalty covers prompt + output
    # the output index of the token this row samples: for min_tokens and the draw; None: len(output_ids)
    num_output: int | None = None
    eos_ids: tuple[int, ...] = ()  # banned with stop_token_ids until min_tokens are out
    grammar: GrammarMatcher | None = None  # the sample's grammar state; its mask applies this step


@dataclass
class SampledRows:
    """The rows that draw at random (not greedy), as a sub-batch of S rows."""

    index: torch.Tensor | None  # [S] positions in the batch; None when S == B
    uniform: torch.Tensor  # [S, 1] float64: each row's token_uniform(seed, output index)
    temperature: torch.Tensor  # [S, 1]
    top_k: torch.Tensor | None  # [S, 1] int64, V when off; None when no row uses it
    max_top_k: int
    top_p: torch.Tensor | None  # [S, 1], TOP_P_OFF when off; None when no row uses it
    min_p: torch.Tensor | None  # [S, 1], 0 when off; None when no row uses it


@dataclass
class SamplingBatch:
    size: int
    vocab_size: int
    # logit_bias and min_tokens bans as one sparse add into the flattened [B * V] logits
    # (a ban adds -inf). None when no row has either.
    edit_index: torch.Tensor | None
    edit_value: torch.Tensor | None
    penalties: Penalties | None
    # grammar masks of the constrained rows (other rows allow everything); None when no row has one
    grammar_mask: torch.Tensor | None
    grammar_backend: GrammarBackend | None
    sampled: SampledRows | None  # None when every row is greedy
    any_greedy: bool
    # -1: no logprobs; 0: chosen token's only; k > 0: chosen + top-k (same k for all rows)
    num_logprobs: int

    @property
    def needs_edits(self) -> bool:
        return self.edit_index is not None or self.penalties is not None or self.grammar_mask is not None

    @classmethod
    def build(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device | str
    ) -> SamplingBatch:
        device = torch.device(device)
        edit_index: list[int] = []
        edit_value: list[float] = []
        num_logprobs = -1
        sample_pos: list[int] = []
        uniforms: list[float] = []
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        for i, row in enumerate(rows):
            p = row.params
            base = i * vocab_size
            if p.logit_bias:
                edit_index.extend(base + t for t in p.logit_bias)
                edit_value.extend(p.logit_bias.values())
            n_out = len(row.output_ids) if row.num_output is None else row.num_output
            # a grammar decides when a constrained sample may stop: a ban could leave no token
            if n_out < p.min_tokens and row.grammar is None:
                # With ignore_eos, EOS does not stop the request, so it needs no ban.
                banned = p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *row.eos_ids]
                edit_index.extend(base + t for t in banned)
                edit_value.extend([float("-inf")] * len(banned))
            if p.wants_logprobs:
                num_logprobs = max(num_logprobs, p.top_logprobs)
            if not p.is_greedy:
                seed = fresh_seed() if row.seed is None else row.seed
                uniforms.append(token_uniform(seed, n_out))
                sample_pos.append(i)
                temps.append(max(p.temperature, MIN_TEMPERATURE))
                top_ks.append(min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size)
                top_ps.append(p.top_p if p.top_p < 1.0 else TOP_P_OFF)
                min_ps.append(p.min_p)

        edits_i = edits_v = None
        if edit_index:
            # accumulate=True at apply time sums duplicates, so bias + ban on one token = -inf.
            edits_i = to_device(edit_index, device, torch.int64)
            edits_v = to_device(edit_value, device, torch.float32)

        grammar_mask, grammar_backend = _grammar_mask(rows)
        return cls(
            size=len(rows),
            vocab_size=vocab_size,
            edit_index=edits_i,
            edit_value=edits_v,
            penalties=Penalties.build(rows, vocab_size, device),
            grammar_mask=grammar_mask,
            grammar_backend=grammar_backend,
            sampled=_sampled_rows(
                len(rows), vocab_size, device, sample_pos, uniforms, temps, top_ks, top_ps, min_ps
            ),
            any_greedy=len(sample_pos) < len(rows),
            num_logprobs=min(num_logprobs, vocab_size),
        )


def _grammar_mask(rows: Sequence[SamplingRow]) -> tuple[torch.Tensor | None, GrammarBackend | None]:
    constrained = [(i, row.grammar) for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained:
        return None, None
    backend = constrained[0][1].backend
    mask = backend.allocate_mask(len(rows))
    for i, matcher in constrained:
        matcher.fill_mask(mask, i)
    return mask, backend


def _sampled_rows(
    size: int,
    vocab_size: int,
    device: torch.device,
    positions: list[int],
    uniforms: list[float],
    temps: list[float],
    top_ks: list[int],
    top_ps: list[float],
    min_ps: list[float],
) -> SampledRows | None:
    if not positions:
        return None
    # one copy: the uniforms need float64 (52 random bits), the knobs are float32 after one cast
    packed = to_device([uniforms, temps, top_ps, min_ps], device, torch.float64).unsqueeze(-1)  # [4, S, 1]
    floats = packed[1:].float()
    use_top_k = min(top_ks) < vocab_size
    use_top_p = min(top_ps) < TOP_P_OFF
    partial = len(positions) < size
    index = top_k = None
    if use_top_k or partial:
        ints = to_device([top_ks, positions], device, torch.int64)
        top_k = ints[0].unsqueeze(-1) if use_top_k else None
        index = ints[1] if partial else None
    return SampledRows(
        index=index,
        uniform=packed[0],
        temperature=floats[0],
        top_k=top_k,
        max_top_k=max(top_ks),
        top_p=floats[1] if use_top_p else None,
        min_p=floats[2] if max(min_ps) > 0 else None,
    )
