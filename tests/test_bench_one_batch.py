"""`ketch bench one-batch` on a tiny random model (CPU), and the profiler-trace summary it prints."""
from __future__ import annotations

import json

import pytest
import torch

from ketch.bench.trace_summary import STEP_ANNOTATION, family, summarize, summarize_file
from ketch.cli import main


def _x(name: str, cat: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_summary_counts_busy_time_inside_the_annotated_steps_only():
    trace = {"traceEvents": [
        _x(STEP_ANNOTATION, "user_annotation", 0, 100),  # the first step: a warm-in, not counted
        _x("in_the_first_step", "kernel", 5, 80),
        _x(STEP_ANNOTATION, "user_annotation", 100, 100),  # window 100..300
        _x(STEP_ANNOTATION, "user_annotation", 200, 100),
        _x("ampere_bf16_gemm", "kernel", 110, 40),  # 110..150
        _x("ampere_bf16_gemm", "kernel", 140, 20),  # overlaps: union 110..160 (a second stream)
        _x("vectorized_elementwise_kernel", "kernel", 210, 10),
        _x("Memcpy HtoD", "gpu_memcpy", 290, 20),  # clipped at 300: 10 inside
        _x("before_the_window", "kernel", 10, 40),  # ignored
        _x("aten::mm", "cpu_op", 100, 200),  # CPU side: never busy GPU time
        {"ph": "i", "name": STEP_ANNOTATION, "cat": "user_annotation", "ts": 0},  # not a span
    ]}
    s = summarize(trace)
    assert s.steps == 2 and s.window_us == 200
    assert s.busy_us == 50 + 10 + 10
    assert s.idle_fraction == pytest.approx(1 - 70 / 200)
    assert (s.kernels, s.copies) == (3, 1) and s.kernels_per_step == 1.5
    assert s.by_name[0] == ("ampere_bf16_gemm", 60.0, 2)
    assert s.by_family["gemm/gemv"] == 60 and s.by_family["elementwise"] == 10 and s.by_family["copy/cast"] == 10
    assert "kernels per step: 1.5" in s.format()
    # advances: the first gemm moves the frontier 110 -> 150, the overlapping one 150 -> 160
    assert s.advance == {"ampere_bf16_gemm": 50.0, "vectorized_elementwise_kernel": 10.0, "Memcpy HtoD": 10.0}
    assert sum(s.advance.values()) == s.busy_us


def test_advance_charges_a_kernel_launched_early_only_past_the_one_before():
    """PDL: a kernel launched during the one before it waits inside its programs; its duration
    overlaps, its advance is only the time its end adds (the critical path's share)."""
    trace = {"traceEvents": [
        _x(STEP_ANNOTATION, "user_annotation", 0, 10),
        _x(STEP_ANNOTATION, "user_annotation", 10, 100),  # window 10..110
        _x("stream", "kernel", 10, 30),  # 10..40
        _x("early_small", "kernel", 15, 28),  # launched early, waits, ends at 43: advance 3
        _x("stream", "kernel", 40, 40),  # launched early too: 40..80, advance 80 - 43 = 37
        _x("after_a_gap", "kernel", 90, 5),  # idle 80..90 is nobody's advance
    ]}
    s = summarize(trace)
    assert s.advance == {"stream": 30.0 + 37.0, "early_small": 3.0, "after_a_gap": 5.0}
    assert dict((n, us) for n, us, _ in s.by_name)["early_small"] == 28.0
    assert sum(s.advance.values()) == s.busy_us == 75.0
    assert "advance      3.0 µs/step  early_small" in s.format()  # one step in the window


def test_summary_without_step_annotations_is_a_clear_error():
    with pytest.raises(ValueError, match="record_function"):
        summarize({"traceEvents": [_x("k", "kernel", 0, 1)]})
    with pytest.raises(ValueError, match="at least 2"):
        summarize({"traceEvents": [_x(STEP_ANNOTATION, "user_annotation", 0, 10)]})


def test_kernel_families():
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm/gemv"
    assert family("pytorch_flash::flash_fwd_kernel") == "attention, extend/SDPA"
    assert family("_decode_split_kernel") == family("_decode_merge_kernel") == "attention, decode"
    assert family("_extend_kernel") == "attention, extend/SDPA"
    assert family("_gemv_kernel") == "gemm/gemv"
    assert family("_rms_norm_kernel") == family("_store_kv_kernel") == "norm/rope/kv store"
    assert family("indexSelectLargeIndex") == "index/gather/scatter"
    assert family("something_else") == "other"


@pytest.fixture(autouse=True)
def _threads_restored():
    """The in-process CLI runs below set torch's global thread count (--num-threads 1): give it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _one_batch(tiny_config_path: str, tmp_path, *extra: str) -> int:
    return main(["bench", "one-batch", "--model", tiny_config_path, "--load-format", "dummy", "--dtype", "float32",
                 "--kv-cache-memory", str(2 << 20), "--page-size", "4", "--num-threads", "1",
                 "--batch-size", "3", "--input-len", "40", "--max-num-batched-tokens", "16", *extra])


@pytest.mark.parametrize("mode", ["--disable-overlap-schedule", "--overlap-schedule"])
def test_one_batch_prefills_the_whole_batch_in_one_step_and_times_decode(tiny_config_path, tmp_path, capsys, mode):
    out, trace = tmp_path / "r.json", tmp_path / "trace.json"
    rc = _one_batch(tiny_config_path, tmp_path, "--output-len", "9", "--warmup-output-len", "2", mode,
                    "--output-file", str(out), "--profile", str(trace), "--profile-steps", "4")
    assert rc == 0
    res = json.loads(out.read_text())
    r = res["result"]
    # the token budget (16 here) is raised so 3 x 40 prompt tokens go in one step
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (3, 40, 9)
    assert r["prefill_tok_s"] == pytest.approx(3 * 40 / (r["prefill_ms"] / 1e3), rel=1e-2)
    assert r["decode_step_ms_p10"] <= r["decode_step_ms_median"] <= r["decode_step_ms_p90"]
    assert r["decode_tok_s"] == pytest.approx(3 / (r["decode_step_ms_median"] / 1e3), rel=1e-2)
    assert summarize_file(str(trace)).steps == 3  # the profiled decode steps but the first (a warm-in)
    assert res["profile"]["kernels_per_step"] == 0  # CPU run: no GPU kernels
    printed = capsys.readouterr().out
    assert "batch 3 | in 40 out 9" in printed and "profiled steps: 3" in printed


def test_one_batch_rejects_a_run_without_decode_steps(tiny_config_path, tmp_path, capsys):
    assert _one_batch(tiny_config_path, tmp_path, "--output-len", "1") == 2
    assert "output_len must be >= 2" in capsys.readouterr().err


class _FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return other.t - self.t


def test_gpu_timeline_idle_is_the_gaps_between_consecutive_steps(monkeypatch):
    from ketch.bench.gpu_timeline import StepTimeline

    monkeypatch.setattr("torch.cuda.synchronize", lambda *a: None)
    tl = StepTimeline(engine=None)
    # a prefill (0..50, skipped), then steps of 10 ms busy with gaps 0, 2, 0 before the next
    for start, end in [(0, 50), (50, 60), (60, 70), (72, 82), (82, 92)]:
        tl.marks.append((_FakeEvent(start), _FakeEvent(end)))
    s = tl.summary(skip=1)
    assert s.steps == 3 and s.busy_ms == 10 and s.gap_ms == 0
    assert s.idle_fraction == pytest.approx(2 / 32)


def test_gpu_timeline_phases_split_busy_time_by_step_kind(monkeypatch):
    from types import SimpleNamespace

    from ketch.bench.gpu_timeline import StepTimeline, shape_of

    def chunk(num_computed: int, num_new: int):
        return SimpleNamespace(num_new=num_new, req=SimpleNamespace(num_computed=num_computed))

    prefill = shape_of([chunk(0, 30), chunk(10, 1)])  # a prompt chunk beside one decode row
    decode = shape_of([chunk(40, 1), chunk(11, 1)])
    assert (prefill.decode_rows, prefill.new_tokens, prefill.decode_kv_tokens, prefill.decode_only) == (1, 31, 11, False)
    assert (decode.decode_rows, decode.new_tokens, decode.decode_kv_tokens, decode.decode_only) == (2, 2, 41 + 12, True)

    monkeypatch.setattr("torch.cuda.synchronize", lambda *a: None)
    tl = StepTimeline(engine=None)
    for (start, end), shape in zip([(0, 50), (50, 60), (61, 71), (75, 80)], [prefill, decode, decode, prefill]):
        tl.marks.append((_FakeEvent(start), _FakeEvent(end)))
        tl.shapes.append(shape)
    ph = tl.phases()
    d, p = ph["decode"], ph["prefill"]
    assert (d.steps, d.busy_s, d.gap_s, d.decode_rows, d.decode_kv_tokens) == (2, 0.020, 0.005, 4, 106)
    assert (p.steps, p.busy_s, p.gap_s, p.new_tokens) == (2, 0.055, 0.0, 62)
    assert tl.rows() == [(50, 0, 31, 1, 11), (10, 1, 2, 2, 53), (10, 4, 2, 2, 53), (5, 0, 31, 1, 11)]

    from ketch.bench.offline import format_phases

    text = format_phases({k: vars(v) for k, v in ph.items()}, kv_bytes_per_token=10**9, total_s=0.1)
    assert "KV read 0.1 TB = 5.30 TB/s" in text and "60 prompt tokens + 2 decode rows" in text


def test_profile_windows_parse_and_reject_bad_input():
    from ketch.bench.profile_windows import Window, parse_windows

    assert parse_windows("600:606, 10:14") == [Window(10, 14), Window(600, 606)]
    for bad in ("10", "a:b", "5:6", "-1:4", "0:4,2:6"):
        with pytest.raises(ValueError, match="profile_windows"):
            parse_windows(bad)


def test_offline_profiles_the_chosen_step_windows(tiny_config_path, tmp_path, capsys):
    prefix = tmp_path / "t"
    rc = main(["bench", "offline", "--model", tiny_config_path, "--load-format", "dummy", "--dtype", "float32",
               "--kv-cache-memory", str(2 << 20), "--page-size", "4", "--num-threads", "1", "--max-num-seqs", "2",
               "--batch-sizes", "3", "--input-len", "8", "--output-len", "6",
               "--profile", str(prefix), "--profile-windows", "1:4,6:9"])
    assert rc == 0
    printed = capsys.readouterr().out
    from ketch.bench.trace_summary import summarize_file

    for label in ("1-4", "6-9"):
        path = f"{prefix}.b3.{label}.json"
        assert summarize_file(path).steps == 2  # three profiled steps, the first a warm-in
        assert f"profile of steps {label} (run 1): {path}" in printed


def test_offline_decode_counts_only_tokens_after_every_first_token(tiny_config_path):
    """6 requests, 2 running at a time: the 'decode' phase is the last two decoding alone."""
    import random

    from conftest import make_tiny_engine
    from ketch.bench.offline import measure

    engine = make_tiny_engine(tiny_config_path, max_num_seqs=2)
    r = measure(engine, batch=6, input_len=8, output_len=5, rng=random.Random(0), tag="t")
    assert r["decode_tokens"] == 2 * 4  # not 6 * 4: four requests were done before the last first token
    # request, input, output and total throughput share one clock
    assert r["input_tok_s"] == pytest.approx(8 * r["request_s"], rel=1e-2)
    assert r["total_tok_s"] == pytest.approx(r["input_tok_s"] + r["output_tok_s"], rel=1e-2)
