"""Programmatic dependent launch (PDL) in ketch's Triton kernels (ketch/kernels/README.md).

CPU: the switch (off in the interpreter / without a Hopper GPU / with KETCH_DISABLE_PDL=1).
GPU (sm_90+): decode-like kernel chains, eager and in CUDA graphs, give the same bits with PDL
on as with it off, including in-place kernels right after a kernel that reads the same buffer.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

from ketch.kernels import _common
from ketch.kernels._common import pdl_enabled, pdl_launch, use_pdl
from ketch.kernels.activation import _silu_and_mul_kernel, silu_and_mul
from ketch.kernels.decode_attention import decode_attention
from ketch.kernels.gemv import gemv
from ketch.kernels.kv_store import store_kv
from ketch.kernels.rmsnorm import add_rms_norm
from ketch.kernels.rotary import rotary

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
hopper_only = pytest.mark.skipif(not HOPPER, reason="PDL needs a CUDA GPU of compute capability >= 9.0")


# ---------------------------------------------------------------- the switch (CPU)


@pytest.mark.parametrize("interp,cuda,cap,env,want", [
    (False, True, (9, 0), None, True),
    (False, True, (10, 0), "0", True),
    (False, True, (9, 0), "1", False),  # the A/B switch
    (True, True, (9, 0), None, False),  # the interpreter never sees gdc ops
    (False, False, None, None, False),  # CPU
    (False, True, (8, 9), None, False),  # Ada: no griddepcontrol
])
def test_pdl_enabled_truth_table(interp: bool, cuda: bool, cap: tuple[int, int] | None, env: str | None, want: bool) -> None:
    assert pdl_enabled(interpreting=interp, cuda_available=cuda, capability=cap, disable_env=env) is want


def test_use_pdl_reads_its_inputs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wiring of use_pdl() to the real inputs, faked as a Hopper GPU outside the interpreter."""
    monkeypatch.setattr(_common, "_pdl", None)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv("KETCH_DISABLE_PDL", "1")
    assert use_pdl() is False
    monkeypatch.delenv("KETCH_DISABLE_PDL")
    assert use_pdl() is False  # resolved once: a later change of the env has no effect
    monkeypatch.setattr(_common, "_pdl", None)
    assert use_pdl() is True
    assert pdl_launch() == {"USE_PDL": True, "launch_pdl": True}


def test_early_trigger_needs_the_switch_pdl_and_a_one_wave_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """EARLY_TRIGGER only with PDL on and for a grid of at most one program per SM; on by default,
    KETCH_PDL_EARLY=0 turns it off; kernels without the constexpr get no key."""
    monkeypatch.setattr(_common, "_pdl", True)
    monkeypatch.setattr(_common, "_sm_count", 132)
    monkeypatch.setattr(_common, "_early", None)
    monkeypatch.setenv("KETCH_PDL_EARLY", "0")
    assert pdl_launch(1)["EARLY_TRIGGER"] is False and "EARLY_TRIGGER" not in pdl_launch()
    monkeypatch.setattr(_common, "_early", None)
    monkeypatch.delenv("KETCH_PDL_EARLY", raising=False)
    assert pdl_launch(132)["EARLY_TRIGGER"] is True and pdl_launch(133)["EARLY_TRIGGER"] is False
    monkeypatch.setattr(_common, "_pdl", False)
    monkeypatch.setattr(_common, "_early", None)
    assert pdl_launch(1) == {"USE_PDL": False, "launch_pdl": False, "EARLY_TRIGGER": False}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU / interpreter case")
def test_pdl_off_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "_pdl", None)
    assert pdl_launch() == {"USE_PDL": False, "launch_pdl": False}


# ---------------------------------------------------------------- GPU: same bits on and off

EPS = 1e-5
HID, H, KVH, D, INTER, PAGE, CTX = 1024, 8, 2, 128, 2048, 16, 200


def _layer(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) / k**0.5).to("cuda", torch.bfloat16)

    pages = 64
    return {"qkv": w((H + 2 * KVH) * D, HID), "o": w(HID, H * D), "gu": w(2 * INTER, HID), "down": w(HID, INTER),
            "n1": (1 + 0.1 * torch.randn(HID, generator=gen)).to("cuda", torch.bfloat16),
            "n2": (1 + 0.1 * torch.randn(HID, generator=gen)).to("cuda", torch.bfloat16),
            "kc": torch.randn(pages, PAGE, KVH, D, generator=gen).to("cuda", torch.bfloat16),
            "vc": torch.randn(pages, PAGE, KVH, D, generator=gen).to("cuda", torch.bfloat16)}


def _decode_chain(layers: list[dict[str, torch.Tensor]], st: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """One decode step over `layers`: every kernel consumes the previous one's output."""
    x, res = st["x"], st["res"]
    b = x.shape[0]
    for lay in layers:
        h, res = add_rms_norm(x, res, lay["n1"], EPS)
        qkv = gemv(h, lay["qkv"]).view(b, H + 2 * KVH, D)
        qk = qkv[:, : H + KVH]
        rotary(qk, st["cos"], st["sin"], out=qk)  # in place, right after the gemv that wrote it
        store_kv(lay["kc"], lay["vc"], qkv[:, H : H + KVH], qkv[:, H + KVH :], st["slots"])
        attn = decode_attention(qkv[:, :H], lay["kc"], lay["vc"], st["table"], st["lens"], D**-0.5, num_splits=4)
        x = gemv(attn.reshape(b, H * D), lay["o"])
        h, res = add_rms_norm(x, res, lay["n2"], EPS)
        x = gemv(silu_and_mul(gemv(h, lay["gu"])), lay["down"])
    return [x, res] + [t for lay in layers for t in (lay["kc"], lay["vc"])]


def _inputs(b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    need = -(-CTX // PAGE)  # disjoint pages per sequence: no two rows store into one slot
    table = torch.randperm(64, generator=gen)[: b * need].view(b, need).int()
    pos = torch.full((b,), CTX - 1)
    slots = table[torch.arange(b), pos // PAGE].long() * PAGE + pos % PAGE
    ang = torch.randn(b, D // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)
    cuda = {"table": table, "slots": slots.int(), "lens": torch.full((b,), CTX, dtype=torch.int32)}
    bf = {"x": torch.randn(b, HID, generator=gen), "res": torch.randn(b, HID, generator=gen), "cos": cos, "sin": sin}
    return {**{k: v.cuda() for k, v in cuda.items()}, **{k: v.to("cuda", torch.bfloat16) for k, v in bf.items()}}


def _run(fn, pristine: list[torch.Tensor], live: list[torch.Tensor], pdl: bool, monkeypatch: pytest.MonkeyPatch,
         graph: bool, replays: int = 4) -> list[list[torch.Tensor]]:
    """fn's outputs (cloned) after each run: eager once, or `replays` replays of one captured
    graph; `live` (buffers fn mutates) is reset from `pristine` before every run."""
    monkeypatch.setattr(_common, "_pdl", pdl)

    def reset() -> None:
        for dst, src in zip(live, pristine):
            dst.copy_(src)

    reset()
    outs = fn()  # eager (also compiles and autotunes before any capture)
    torch.cuda.synchronize()
    if not graph:
        return [[t.clone() for t in outs]]
    g = torch.cuda.CUDAGraph()
    reset()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        outs = fn()
    results = []
    for _ in range(replays):
        reset()
        g.replay()
        torch.cuda.synchronize()
        results.append([t.clone() for t in outs])
    return results


def _assert_same_bits(got: list[list[torch.Tensor]], want: list[torch.Tensor]) -> None:
    for r, outs in enumerate(got):
        for i, (a, b) in enumerate(zip(outs, want, strict=True)):
            assert torch.equal(a, b), f"run {r}, output {i}: max |diff| {(a.float() - b.float()).abs().max().item()}"


@hopper_only
def test_pdl_is_on_and_compiled_in() -> None:
    if os.environ.get("KETCH_DISABLE_PDL") == "1":
        pytest.skip("KETCH_DISABLE_PDL=1")
    assert use_pdl()
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 128, device="cuda", dtype=torch.bfloat16)
    k = _silu_and_mul_kernel[(1, 1)](x, out, x.stride(0), out.stride(0), INTER=128, BLOCK=128, **pdl_launch(1))
    assert k.metadata.launch_pdl and "griddepcontrol.wait" in k.asm["ptx"]


@hopper_only
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("batch", [1, 4])  # gemv's M=1 FMA path and M=2..8 tensor-core path
def test_decode_chain_same_bits_with_and_without_pdl(batch: int, graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(batch)
    layers = [_layer(gen) for _ in range(3)]
    st = _inputs(batch, gen)
    live = [t for lay in layers for t in (lay["kc"], lay["vc"])]
    pristine = [t.clone() for t in live]
    fn = lambda: _decode_chain(layers, st)
    want = _run(fn, pristine, live, False, monkeypatch, graph=False)[0]
    assert all(bool(t.float().isfinite().all()) for t in want[:2])
    _assert_same_bits(_run(fn, pristine, live, True, monkeypatch, graph), want)


@hopper_only
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("reader", ["gemv", "add_rms_norm"])
def test_in_place_write_after_a_reader_waits_for_it(reader: str, graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """RoPE in place on a buffer the previous kernel is still reading (a long gemv: a wide race
    window) must not change what that kernel read: the write happens after gdc_wait."""
    gen = torch.Generator().manual_seed(7)
    heads, n = 48, 16384
    buf = torch.randn(1, heads * D, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(n, heads * D, generator=gen) / 80).to("cuda", torch.bfloat16)  # ~200 MB: > L2
    res = torch.randn(1, heads * D, generator=gen).to("cuda", torch.bfloat16)
    nw = torch.ones(heads * D, device="cuda", dtype=torch.bfloat16)
    ang = torch.randn(1, D // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to("cuda", torch.bfloat16)
    sin = torch.cat([-ang.sin(), ang.sin()], -1).to("cuda", torch.bfloat16)

    def fn() -> list[torch.Tensor]:
        read = list(add_rms_norm(buf, res, nw, EPS)) if reader == "add_rms_norm" else [gemv(buf, w)]
        view = buf.view(1, heads, D)
        rotary(view, cos, sin, out=view)
        return read + [buf]

    pristine = [buf.clone()]
    want = _run(fn, pristine, [buf], False, monkeypatch, graph=False)[0]
    assert not torch.equal(want[-1], pristine[0])  # the rotation did change the buffer
    _assert_same_bits(_run(fn, pristine, [buf], True, monkeypatch, graph), want)
