"""A layer's later weights asked into L2 on a side stream, while its latency-bound kernels run.

    ahead(tokens, weights_of)   weights_of() -> {site: [tensors]}; the tensors of the sites that
                                SITES names are prefetched beside the layer's chain
    join()                      the current stream waits for the side stream (the forward's end)

Why: at one decode row a layer alternates weight streams with kernels bound by latency (attention
over a short context, the routing); while those run, HBM idles. Some later weights are known at
the layer's start: o_proj's, and DeepSeek's shared experts (every token's picks), 23-35 MB of
V2-Lite's ~140 MB of expert bytes a layer. With them in L2 the fused MoE's shared tiles are read
from there while its routed tiles take all of HBM.

Two earlier forms lost (docs/performance.md, runs 72-73 and 84): a prefetch kernel inside the PDL
chain (the chain waited for its bulk copies) and prefetches issued by the products themselves
before their wait (they competed with their own stream). Here the prefetch is a branch beside
the chain: after the layer's first product the current stream records an event, the side stream
waits for it and launches `_l2_prefetch_kernel`, and nothing on the chain waits for that kernel
until `join` at the forward's end. Only while a CUDA graph is captured, where it becomes a fork
(an edge from the first product's node) and one join; an eager step would pay its host time.

A hint only: what is not in L2 when a product runs is read from HBM as before, so the outputs
are bit for bit those without it (tests/test_l2_ahead.py natively). Off by default (SITES = "")
until a same-run A/B on the GPU says it wins. sm_90+ (`cp.async.bulk.prefetch.L2`); not under
the interpreter, which has no inline assembly.

    grid: (PROGRAMS,), one warp each; every lane asks for one CHUNK of a span at a time
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ketch.kernels._common import interpreting

# The sites prefetched, comma-separated (the layers' names): "o_proj" (the attention's output
# product), "shared" (DeepSeek's shared experts' gate|up slots), "shared_down" (their down
# slots). "": off. Read at each call (scripts/with_constants.py sweeps it).
SITES = ""
MAX_TOKENS = 1  # steps of more rows stream their weights with enough bytes in flight already
PROGRAMS = 16  # one SM's bulk prefetches reached ~250 GB/s (run 72): 16 cover HBM
CHUNK = 1 << 14  # bytes a lane asks for at a time (any multiple of 16 is legal)
LANES = 32
MAX_SPANS = 4  # spans a launch (more: several launches)
ALIGN = 16  # the instruction's address and size granularity


@triton.jit
def _prefetch_span(addr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """This program's slice of [addr, addr + nbytes): one CHUNK a lane; lanes past the slice ask
    for 0 bytes (a predicate skips them: the instruction has no mask)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    per = tl.cdiv(tl.cdiv(nbytes, programs), CHUNK) * CHUNK
    start = pid.to(tl.int64) * per
    end = tl.minimum(start + per, nbytes)
    lanes = tl.arange(0, LANES).to(tl.int64)
    for c0 in range(0, tl.cdiv(per, CHUNK), LANES):
        off = start + (c0 + lanes) * CHUNK
        size = tl.minimum(end - off, CHUNK)
        size = tl.where(size > 0, size, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }\n"
            "mov.u32 $0, 0;",
            "=r,l,r", [addr + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(A0, N0, A1, N1, A2, N2, A3, N3, CHUNK: tl.constexpr, LANES: tl.constexpr):
    # no PDL: this kernel is off the chain (its own stream or graph branch)
    _prefetch_span(A0, N0, CHUNK, LANES)
    _prefetch_span(A1, N1, CHUNK, LANES)
    _prefetch_span(A2, N2, CHUNK, LANES)
    _prefetch_span(A3, N3, CHUNK, LANES)


def spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor's elements, the start rounded down and the end up to the
    instruction's 16 bytes (a few bytes of a neighbour: a hint, inside the same allocation for
    the weights' 16-byte aligned storage). Contiguous tensors only: ValueError otherwise."""
    out = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"l2_ahead: tensors must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        lo, hi = start - start % ALIGN, end + (-end) % ALIGN
        out.append((lo, hi - lo))
    return out


def chosen(weights: dict[str, list[torch.Tensor]], sites: str) -> list[torch.Tensor]:
    """The tensors of the sites named in `sites` (comma-separated), in the layer's order. A
    name no layer offers is an error (a typo would silently time nothing)."""
    names = [s for s in sites.split(",") if s]
    unknown = set(names) - KNOWN_SITES
    if unknown:
        raise ValueError(f"l2_ahead.SITES: unknown site(s) {sorted(unknown)}; known: {sorted(KNOWN_SITES)}")
    return [t for site, ts in weights.items() if site in names for t in ts]


KNOWN_SITES = frozenset({"o_proj", "shared", "shared_down"})
_side: dict[int, torch.cuda.Stream] = {}  # per device
_pending: set[int] = set()  # devices whose side stream has work the current stream has not joined


def ahead(tokens: int, weights_of: Callable[[], dict[str, list[torch.Tensor]]]) -> None:
    """Prefetch the SITES tensors of weights_of() beside the current stream's work, from its
    current point on (module docstring), while a CUDA graph is captured; nothing at steps of
    more than MAX_TOKENS rows, in eager steps, off CUDA or under the interpreter."""
    if not SITES or tokens > MAX_TOKENS or interpreting():
        return
    tensors = chosen(weights_of(), SITES)
    if not tensors or not tensors[0].is_cuda or not torch.cuda.is_current_stream_capturing():
        return  # eagerly, a launch more a layer would cost more host time than it saves
    device = tensors[0].device
    main = torch.cuda.current_stream(device)
    side = _side.get(device.index)
    if side is None:
        side = _side[device.index] = torch.cuda.Stream(device)
    side.wait_stream(main)
    todo = spans(tensors)
    with torch.cuda.stream(side):
        for i in range(0, len(todo), MAX_SPANS):
            group = todo[i:i + MAX_SPANS]
            group += [(group[0][0], 0)] * (MAX_SPANS - len(group))
            _l2_prefetch_kernel[(PROGRAMS,)](*[x for span in group for x in span], CHUNK=CHUNK, LANES=LANES,
                                             num_warps=1)
    _pending.add(device.index)


def join() -> None:
    """The current stream waits for every side stream with unjoined prefetches (a captured
    graph must end with its branches joined)."""
    for index in list(_pending):
        torch.cuda.current_stream(index).wait_stream(_side[index])
        _pending.discard(index)
