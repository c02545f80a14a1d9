"""Compile every kernel for an NVIDIA GPU without one (Triton and the ptxas bundled with it),
and report registers and spills per kernel.

The CPU interpreter checks the math; only the compiler sees layout/type errors and register
pressure, so CPU CI runs this too. Launch settings mirror the wrappers' defaults; arguments get
the 16-divisibility the JIT infers on a GPU from aligned pointers and strides.

    python -m ketch.kernels.compile_check [--arch 90] [--heads 32 --kv-heads 8 --head-dim 128]
    python -m ketch.kernels.compile_check --mla [--heads 16] [--kv-dtype fp8e4nv]   (DeepSeek MLA)

Must run without TRITON_INTERPRET (the kernels have to be JIT functions).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ketch.kernels._common import pow2
from ketch.kernels.activation import _silu_and_mul_kernel
from ketch.kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel
from ketch.kernels.extend_attention import _extend_kernel
from ketch.kernels.gemv import _configs as _gemv_configs
from ketch.kernels.gemv import _gemv_kernel, whole_row_warps, whole_rows
from ketch.kernels.head_gemv import _head_gemv_kernel
from ketch.kernels.kv_store import _store_kv_kernel, _store_rows_kernel
from ketch.kernels.mla_decode import _mla_decode_split_kernel
from ketch.kernels.mla_prepare import _mla_prepare_absorb_kernel, _mla_prepare_kernel
from ketch.kernels.page_copy import MAX_BLOCK_BYTES, _copy_pages_kernel
from ketch.kernels.head_position import _qk_rms_norm_kernel
from ketch.kernels.rmsnorm import _rms_norm_kernel
from ketch.kernels.rotary import _rotary_kernel


SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one CTA may take on sm_90


@dataclass(frozen=True)
class Usage:
    name: str
    registers: int
    spill_bytes: int  # stack frame: registers spilled to local memory
    loads_before_wait: int  # PDL: global loads issued before griddepcontrol.wait (-1: no wait)
    stores_before_wait: int  # must be 0: a store before the wait races the previous kernel
    trigger_first: bool = False  # griddepcontrol.launch_dependents before the wait (EARLY_TRIGGER)
    shared_bytes: int = 0  # static shared memory a CTA takes (cp.async stages)
    async_copies: bool = False  # loads pipelined through cp.async into shared memory

    def pipelined(self) -> bool:
        """cp.async stages that fit one CTA's shared memory on sm_90 (227 KB)."""
        return self.async_copies and self.shared_bytes <= SM90_SHARED_BYTES


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any], arch: int, num_warps: int, num_stages: int,
             aligned: tuple[str, ...] = ()) -> Any:
    """`aligned`: more integer arguments the JIT would see as multiples of 16 (model sizes)."""
    if type(fn).__name__ != "JITFunction":
        raise ValueError("TRITON_INTERPRET: unset it; the interpreter's kernels cannot be compiled")
    sig = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
    # pointers are 16-byte aligned and strides / page sizes multiples of 16, as the JIT infers on a GPU
    divisible = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if sig[n].startswith("*") or n.startswith("stride") or n in ("page_size", "row_words", *aligned)}
    return triton.compile(ASTSource(fn, sig, consts, divisible), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _usage(name: str, kernel: Any) -> Usage:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"cuobjdump: no resource line for {name}")
    ptx = kernel.asm["ptx"]
    at = ptx.find("griddepcontrol.wait")
    head = ptx[:at]
    loads = -1 if at < 0 else len(re.findall(r"\bld\.global", head))
    stores = -1 if at < 0 else len(re.findall(r"\b(?:st|red|atom)\.global", head))
    trigger = ptx.find("griddepcontrol.launch_dependents")
    return Usage(name, int(match.group(1)), int(match.group(2)), loads, stores, 0 <= trigger < at,
                 kernel.metadata.shared, "cp.async.cg.shared.global" in ptx)


def compile_all(arch: int = 90, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                hidden: int = 4096, inter: int = 14336, dtype: str = "bf16", pdl: bool = True,
                kv_dtype: str | None = None, early: bool = False) -> list[Usage]:
    """kv_dtype: the KV pool's Triton type ("fp8e4nv": an fp8 KV cache); None: `dtype`. early: the
    one-wave kernels built with EARLY_TRIGGER (KETCH_PDL_EARLY)."""
    p = f"*{dtype}"
    kv = f"*{kv_dtype or dtype}"
    group, bd = heads // kv_heads, pow2(head_dim, 16)
    prec = "ieee" if dtype == "fp32" else "tf32"
    fixed = {"PageTable": "*i32", "SeqLens": "*i32", "PrefixLens": "*i32", "NewLens": "*i32", "QStarts": "*i32",
             "Slots": "*i32", "MidO": "*fp32", "MidLse": "*fp32", "scale_log2": "fp32", "eps": "fp32",
             "num_splits": "i32", "Bias": p, "KCache": kv, "VCache": kv,
             "Src": "*i64", "Dst": "*i64", "SrcPages": "*i32", "DstPages": "*i32", "row_words": "i32",
             "blocks_per_row": "i32", "total": "i32"}
    fma, dot = _gemv_configs(dot=False)[-1], _gemv_configs(dot=True)[0]  # the widest tiles
    gemv_consts = {"HAS_BIAS": False, "UPCAST": dtype == "fp32", "PRECISION": prec}
    whole_n, whole_k = whole_rows(1, hidden, 4 if dtype == "fp32" else 2) or (1, pow2(hidden))
    position = {"HEADS": heads + kv_heads, "NUM_Q": heads, "N": head_dim, "BLOCK": pow2(head_dim), "TO_FP8": kv != p}
    split_consts = {"GROUP": group, "HEAD_DIM": head_dim, "BLOCK_H": pow2(group, 16), "BLOCK_D": bd, "BLOCK_N": 64,
                    "PRECISION": prec, "FP16_DOTS": kv == "fp8e4nv" and dtype == "bf16"}
    # one split: the split kernel writes the output (the model's dtype) itself
    direct = [("decode_split_direct", _decode_split_kernel, {**split_consts, "DIRECT": True}, 4, 2)]
    cases = [  # name, kernel, constexprs, num_warps, num_stages (as the wrappers launch them)
        ("store_kv", _store_kv_kernel,
         {"KV_HEADS": kv_heads, "HEAD_DIM": head_dim, "BLOCK_H": pow2(kv_heads), "BLOCK_D": pow2(head_dim),
          "TO_FP8": kv != p},
         4 if kv_heads * head_dim >= 1024 else 1, 3),
        *[(f"decode_split{'_skip' if skip else ''}", _decode_split_kernel,  # _skip: past MERGE_BLOCK splits
           {**split_consts, "SKIP_EMPTY": skip}, 4, 2) for skip in (False, True)],
        *[(f"decode_merge{'_blocks' if all_s else ''}", _decode_merge_kernel,  # _blocks: 64 splits, 16 at a time
           {"HEAD_DIM": head_dim, "BLOCK_S": 16 if all_s else 8, "BLOCK_D": bd, "ALL_S": all_s, "SPLIT_BLOCK": 64},
           1 if head_dim <= 64 else 2, 3) for all_s in (0, 64)],
        ("extend", _extend_kernel,
         {"GROUP": group, "HEAD_DIM": head_dim, "V_DIM": head_dim, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": bd,
          "BLOCK_DV": bd, "PRECISION": prec}, 4, 2),
        ("add_rms_norm", _rms_norm_kernel, {"N": hidden, "BLOCK": pow2(hidden), "HAS_RESIDUAL": True},
         min(16, max(1, pow2(hidden) // 256)), 3),
        ("qk_rms_norm", _qk_rms_norm_kernel,  # Qwen3's q / k head norms
         {**position, "NORM": True, "ROTATE": False, "STORE": False}, 1, 3),
        ("qk_norm_rope", _qk_rms_norm_kernel,  # ... with RoPE in the same launch (LayerOps.qk_norm_rotary)
         {**position, "NORM": True, "ROTATE": True, "STORE": False}, 1, 3),
        ("qk_norm_rope_store", _qk_rms_norm_kernel,  # ... and the KV store (LayerOps.position_and_store)
         {**position, "NORM": True, "ROTATE": True, "STORE": True}, 1, 3),
        ("rope_store", _qk_rms_norm_kernel,  # Llama's RoPE and KV store (head_position.rotary_store)
         {**position, "NORM": False, "ROTATE": True, "STORE": True}, 1, 3),
        ("rotary", _rotary_kernel,
         {"HEADS": heads + kv_heads, "HEAD_DIM": head_dim, "BLOCK_H": pow2(heads + kv_heads), "BLOCK_D": pow2(head_dim)},
         4 if (heads + kv_heads) * head_dim >= 2048 else 2, 3),
        ("silu_and_mul", _silu_and_mul_kernel, {"INTER": inter, "BLOCK": min(1024, pow2(inter))},
         4 if min(1024, pow2(inter)) >= 512 else 1, 3),
        ("gemv_m1", _gemv_kernel, {**gemv_consts, "BLOCK_M": 1, **fma.kwargs}, fma.num_warps, fma.num_stages),
        ("gemv_dot", _gemv_kernel, {**gemv_consts, "BLOCK_M": 16, **dot.kwargs}, dot.num_warps, dot.num_stages),
        ("gemv_whole", _gemv_kernel,  # M = 1 whole rows (o_proj, the routers, the LM head)
         {**gemv_consts, "BLOCK_M": 1, "BLOCK_N": whole_n, "BLOCK_K": whole_k}, whole_row_warps(whole_k), 1),
        ("page_copy", _copy_pages_kernel, {"BLOCK": MAX_BLOCK_BYTES // 8}, 4, 3),  # int64 words of a long row
    ]
    return _build(cases, fixed, p, arch, pdl, early) + _build(direct, {**fixed, "MidO": p, "MidLse": p}, p, arch, pdl,
                                                               early)


def compile_mla(arch: int = 90, heads: int = 16, rank: int = 512, rope: int = 64, nope: int = 128, v_dim: int = 128,
                dtype: str = "bf16", pdl: bool = True, kv_dtype: str | None = None, early: bool = False) -> list[Usage]:
    """The MLA kernels at DeepSeek-V2-Lite's shapes, launched as MLATritonBackend launches them
    (ketch/attention/mla_triton_backend.py: decode block_h 16 / block_n 32 / 4 warps, extend
    64 x 32 tiles / 8 warps)."""
    p, kv = f"*{dtype}", f"*{kv_dtype or dtype}"
    prec = "ieee" if dtype == "fp32" else "tf32"
    fixed = {"PageTable": "*i32", "SeqLens": "*i32", "PrefixLens": "*i32", "NewLens": "*i32", "QStarts": "*i32",
             "Slots": "*i32", "MidO": "*fp32", "MidLse": "*fp32", "scale_log2": "fp32", "num_splits": "i32",
             "Cache": kv, "eps": "fp32"}
    cases = [
        ("mla_prepare", _mla_prepare_kernel,  # V2-Lite's 16 heads, interleaved rope pairs
         {"HEADS": heads, "NOPE": nope, "ROPE": rope, "RANK": rank, "INTERLEAVE": True, "BLOCK_H": pow2(heads),
          "BLOCK_ROPE": pow2(rope), "BLOCK_RANK": pow2(rank), "STORE": True, "TO_FP8": kv != p}, 4, 3),
        ("mla_store_rows", _store_rows_kernel,
         {"WIDTH": rank + rope, "BLOCK": pow2(rank + rope), "TO_FP8": kv != p}, 4 if rank + rope >= 1024 else 2, 3),
        *[(f"mla_decode{'_skip' if skip else ''}", _mla_decode_split_kernel,  # _skip: past MERGE_BLOCK splits
           {"HEADS": heads, "RANK": rank, "ROPE": rope, "BLOCK_H": 16, "BLOCK_R": pow2(rank, 16),
            "BLOCK_P": pow2(rope, 16), "BLOCK_N": 32, "PRECISION": prec,
            "FP16_DOTS": kv == "*fp8e4nv" and dtype == "bf16", "SKIP_EMPTY": skip}, 4, 2) for skip in (False, True)],
        *[(f"mla_merge{'_blocks' if all_s else ''}", _decode_merge_kernel,  # _blocks: 64 splits, 16 at a time
           {"HEAD_DIM": rank, "BLOCK_S": 16, "BLOCK_D": pow2(rank, 16), "ALL_S": all_s, "SPLIT_BLOCK": 32}, 4, 3)
          for all_s in (0, 64)],
        ("mla_extend", _extend_kernel,  # expanded form, K/V up-projected in the model's dtype
         {"GROUP": 1, "HEAD_DIM": nope + rope, "V_DIM": v_dim, "BLOCK_M": 64, "BLOCK_N": 32,
          "BLOCK_D": pow2(nope + rope, 16), "BLOCK_DV": pow2(v_dim, 16), "PRECISION": prec}, 8, 2),
    ]
    fma = _gemv_configs(dot=False)[-1]
    # the router's fp32 logits at one token: x in the model's dtype widened against the fp32
    # weight. (2-8 tokens take the fp32 "ieee" dot path, which spills at every tile, as it did
    # when x was widened by a cast launch first.)
    router = [("router_m1", _gemv_kernel, {"HAS_BIAS": False, "UPCAST": True, "PRECISION": "ieee", "BLOCK_M": 1,
                                           **fma.kwargs}, fma.num_warps, fma.num_stages)]
    heads_gemv = [  # the absorbed products at one row, as mla_triton_backend launches them (head_gemv's defaults)
        ("head_gemv_uk", _head_gemv_kernel, {"K": nope, "N": rank, "BLOCK_T": 16, "BLOCK_K": 64, "BLOCK_N": 64,
                                             "BLOCK_S": 1, "MERGE": False, "PRECISION": prec, "ALL_S": 0}, 4, 3),
        ("head_gemv_uv", _head_gemv_kernel, {"K": rank, "N": v_dim, "BLOCK_T": 16, "BLOCK_K": 256, "BLOCK_N": 16,
                                             "BLOCK_S": 1, "MERGE": False, "PRECISION": prec, "ALL_S": 0}, 2, 3),
    ]
    # at one row W_UV's product merges the 16 splits' fp32 partials itself (no merge launch)
    merged = [(f"head_gemv_uv_merged{'_blocks' if all_s else ''}", _head_gemv_kernel,
               {"K": rank, "N": v_dim, "BLOCK_T": 16, "BLOCK_K": 256, "BLOCK_N": 16, "BLOCK_S": 16, "MERGE": True,
                "PRECISION": prec, "ALL_S": all_s, "SPLIT_BLOCK": 32}, 2, 3)
              for all_s in (0, 64)]  # 64: more splits than one tile, merged 16 at a time
    ints = {"rows": "i32", "num_splits": "i32", "SeqLens": "*i32"}
    # a few decode rows: the prepare's program beside the W_UK product's (mla_prepare_absorb)
    absorb = [("mla_prepare_absorb", _mla_prepare_absorb_kernel,
               {**cases[0][2], **heads_gemv[0][2], "PRODUCT_PROGRAMS": heads * rank // 64, "PRODUCT_BLOCKS": rank // 64},
               4, 3)]
    return (_build(cases, {**fixed, "KCache": p, "VCache": p}, p, arch, pdl, early)
            + _build(absorb, {**fixed, **ints}, p, arch, pdl, early)
            + _build(router, {"W": "*fp32", "Y": "*fp32", "Bias": "*fp32"}, p, arch, pdl, early)
            + _build(heads_gemv, ints, p, arch, pdl, early)
            + _build(merged, {**ints, "X": "*fp32", "Lse": "*fp32"}, p, arch, pdl, early))


def _build(cases: list[tuple[str, Any, dict[str, Any], int, int]], fixed: dict[str, str], p: str, arch: int,
           pdl: bool, early: bool = False) -> list[Usage]:
    out = []
    for name, fn, consts, warps, stages in cases:
        if "USE_PDL" in fn.arg_names:
            consts = {**consts, "USE_PDL": pdl}
        if "EARLY_TRIGGER" in fn.arg_names:
            consts = {**consts, "EARLY_TRIGGER": pdl and early}
        sig = {n: fixed.get(n, "i32" if n.startswith("stride") or n == "page_size" else p) for n in fn.arg_names}
        aligned: tuple[str, ...] = ()
        if fn is _gemv_kernel:  # its M, N, K are sizes (elsewhere K is the key pointer)
            sig.update(M="i32", N="i32", K="i32")
            aligned = ("N", "K")  # a model's widths: multiples of 16, which the JIT specializes on (M: the batch)
        out.append(_usage(name, _compile(fn, sig, consts, arch, warps, stages, aligned)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 32; 16 with --mla)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--no-pdl", action="store_true", help="build without the griddepcontrol calls")
    ap.add_argument("--early", action="store_true", help="one-wave kernels trigger their dependents before "
                    "their wait (KETCH_PDL_EARLY)")
    ap.add_argument("--kv-dtype", choices=("fp8e4nv",), default=None, help="KV pool type (default: --dtype)")
    ap.add_argument("--mla", action="store_true", help="the MLA kernels instead (DeepSeek-V2-Lite: --heads 16, "
                    "rank 512 + rope 64, nope 128, v 128)")
    a = ap.parse_args()
    if a.mla:
        usages = compile_mla(a.arch, a.heads or 16, dtype=a.dtype, pdl=not a.no_pdl, kv_dtype=a.kv_dtype, early=a.early)
    else:
        usages = compile_all(a.arch, a.heads or 32, a.kv_heads, a.head_dim, a.hidden, a.inter, a.dtype, not a.no_pdl,
                             a.kv_dtype, a.early)
    for u in usages:
        pdl = "no wait" if u.loads_before_wait < 0 else f"{u.loads_before_wait} loads / {u.stores_before_wait} stores"
        first = "  trigger first" if u.trigger_first else ""
        print(f"{u.name:14s} registers {u.registers:3d}  spilled {u.spill_bytes} B  before PDL wait: {pdl}{first}")


if __name__ == "__main__":
    main()
