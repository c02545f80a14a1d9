"""Judging two greedy runs for the GPU parity tests (tests/test_gpu.py): step-by-step comparison
while both share their context, the fixed fp32 bounds, and the bf16 check against HF
transformers' own bf16 (the bounds and the clauses H, T, N are defined in tests/test_gpu.py's
module docstring)."""
from __future__ import annotations

import dataclasses
import math

import torch
from gpu_util import NEW_TOKENS, NUM_PROMPTS, Run

# fp32 (fixed: its noise is ~1e-5): max |Δlogit| on a shared context over the largest |logit| of
# that step; the reference's top-two gap at a divergence; the fraction of prompts identical
FP32_LOGIT_REL, FP32_NEAR_TIE, FP32_MIN_IDENTICAL = 1e-3, 1e-3, 0.9
# bf16 (tests/test_gpu.py's docstring): ketch's logit error at most this times HF bf16's, measured in the same run
BF16_VS_HF = 1.1
# bf16 (N): a divergence within this many standard deviations of HF bf16's noise on a logit difference
NOISE_Z = 5.0


@dataclasses.dataclass
class Comparison:
    identical: int
    max_abs_diff: float  # over all teacher-forced steps of all prompts
    max_rel_diff: float  # the same over the largest |logit| of that step
    first_step_max_abs_diff: float
    divergences: list[tuple[int, int, float]]  # (prompt, step, reference top-two gap)

    def line(self, name: str) -> str:
        gaps = ", ".join(f"p{p}@{s}:{g:.3g}" for p, s, g in self.divergences) or "none"
        return (f"{name}: identical {self.identical}/{NUM_PROMPTS}; max |Δlogit| first step "
                f"{self.first_step_max_abs_diff:.3g}, all shared steps {self.max_abs_diff:.3g} "
                f"({self.max_rel_diff:.2%} of max |logit|); divergences (prompt@step: ref gap) {gaps}")


def compare(ref: Run, other: Run) -> Comparison:
    identical, max_abs, max_rel, first = 0, 0.0, 0.0, 0.0
    divergences = []
    for p, (rt, ot) in enumerate(zip(ref.tokens, other.tokens, strict=True)):
        assert len(rt) == len(ot) == NEW_TOKENS
        diverge = next((s for s, (a, b) in enumerate(zip(rt, ot, strict=True)) if a != b), None)
        identical += diverge is None
        shared = NEW_TOKENS if diverge is None else diverge + 1  # logits at the divergence share context too
        for s in range(shared):
            r, o = ref.logits[p][s], other.logits[p][s]
            d = float((r - o).abs().max())
            max_abs, max_rel = max(max_abs, d), max(max_rel, d / float(r.abs().max()))
            if s == 0:
                first = max(first, d)
        if diverge is not None:
            r = ref.logits[p][diverge]
            divergences.append((p, diverge, float(r[rt[diverge]] - r[ot[diverge]])))
    return Comparison(identical, max_abs, max_rel, first, divergences)


def check_fp32(cmp: Comparison, name: str) -> None:
    print("\n[float32] " + cmp.line(name))
    assert cmp.max_rel_diff <= FP32_LOGIT_REL, cmp.line(name)
    assert all(gap <= FP32_NEAR_TIE for _, _, gap in cmp.divergences), cmp.line(name)
    assert cmp.identical >= FP32_MIN_IDENTICAL * NUM_PROMPTS, cmp.line(name)


def bit_identical(a: Run, b: Run) -> bool:
    return a.tokens == b.tokens and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a.logits, b.logits, strict=True))


def _tokens_before_divergence(ref: Run, other: Run) -> list[int]:
    return [next((s for s, (a, b) in enumerate(zip(rt, ot, strict=True)) if a != b), NEW_TOKENS)
            for rt, ot in zip(ref.tokens, other.tokens, strict=True)]


def _agreed(ref: Run, other: Run) -> list[int]:
    """Per prompt, the steps whose logits share their context: up to and including the first divergence."""
    return [min(n + 1, NEW_TOKENS) for n in _tokens_before_divergence(ref, other)]


def _rel_error(ref: Run, other: Run, horizon: list[int]) -> float:
    """max |Δlogit| / max |logit| over each prompt's first horizon[p] steps."""
    return max(float((ref.logits[p][s] - other.logits[p][s]).abs().max() / ref.logits[p][s].abs().max())
               for p in range(len(horizon)) for s in range(horizon[p]))


def bf16_ulp(x: float) -> float:
    """The spacing of bf16 numbers (8 significant bits) at |x|: 2^(floor(log2 |x|) - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 0.0


def check_bf16(run: Run, name: str, refs: dict[torch.dtype, Run]) -> None:
    """Hold a bf16 run of ketch to HF transformers' bf16, both against HF fp32 on the same weights
    (the bounds and clauses H, T, N are defined in tests/test_gpu.py's module docstring)."""
    fp32, hf16 = refs[torch.float32], refs[torch.bfloat16]
    ours_at, hf_at = _tokens_before_divergence(fp32, run), _tokens_before_divergence(fp32, hf16)
    horizon = [min(a, b) for a, b in zip(_agreed(fp32, run), _agreed(fp32, hf16), strict=True)]
    mine, theirs = _rel_error(fp32, run, horizon), _rel_error(fp32, hf16, horizon)
    notes, unexplained, only_noise = [], [], 0
    for p, s in enumerate(ours_at):
        if s == NEW_TOKENS:
            continue
        ref = fp32.logits[p][s]
        a, b = fp32.tokens[p][s], run.tokens[p][s]
        gap = float(ref[a] - ref[b])
        if hf_at[p] <= s:
            why = "H"
        elif gap <= bf16_ulp(float(ref[a])):
            why = "T"
        else:  # HF bf16 still shares the context at step s: its error there is its noise on this context
            sigma = float((hf16.logits[p][s] - ref).pow(2).mean().sqrt())
            bound = NOISE_Z * math.sqrt(2.0) * sigma
            why = f"N<={bound:.3g}" if gap <= bound else f"UNEXPLAINED>{bound:.3g}"
            only_noise += gap <= bound
            if gap > bound:
                unexplained.append((p, s, gap))
        notes.append(f"p{p}@{s}:{gap:.3g}({why})")
    identical = sum(n == NEW_TOKENS for n in ours_at)
    line = (f"{name} vs HF fp32: identical {identical}/{NUM_PROMPTS} (HF bf16 "
            f"{sum(n == NEW_TOKENS for n in hf_at)}/{NUM_PROMPTS}); mean tokens before the first "
            f"divergence {sum(ours_at) / NUM_PROMPTS:.1f} (HF bf16 {sum(hf_at) / NUM_PROMPTS:.1f}); "
            f"max |Δlogit| / max |logit| on steps all three share: {mine:.2%}, HF bf16 {theirs:.2%}, "
            f"ratio {mine / theirs:.3f} (bound {BF16_VS_HF}); divergences (prompt@step:fp32 gap(clause)) "
            f"{', '.join(notes) or 'none'}; needed (N): {only_noise} of {len(notes)}")
    print("\n[bfloat16] " + line)
    assert mine <= BF16_VS_HF * theirs, line
    assert not unexplained, line
