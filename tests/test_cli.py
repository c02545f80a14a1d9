"""`ketch generate | chat | bench offline` as real subprocesses on the bundled SmolLM2.

Every run passes `--num-threads 1`: on a small shared CPU box two OpenMP threads that fight other
processes for the cores make each decode step far slower (the flag is part of what is tested).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server_util import free_port, wait_for

REPO = Path(__file__).resolve().parents[1]


def ketch(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ketch.cli", *args, "--num-threads", "1"],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_generate_prints_the_completion():
    r = ketch("generate", "The capital of France is", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and "Paris" in r.stdout  # greedy by default; Paris has a wide margin
    assert r.stdout.endswith("\n")


@pytest.mark.parametrize("flag,value,bad", [("--kv-cache-dtype", "fp8_e4m3", "fp16"),
                                             ("--cpu-activations", "int8", "int4")])
def test_generate_with_a_coarser_number_format(flag, value, bad):
    """An fp8 KV cache, int8 activations in the 4-bit product: still the answer with a wide
    margin; a value the flag does not take exits 2 naming it."""
    r = ketch("generate", "The capital of France is", "--max-tokens", "8", flag, value)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    refused = ketch("generate", "Hello", flag, bad)
    assert refused.returncode == 2 and flag in refused.stderr


def test_chat_answers_each_line_until_eof():
    r = ketch("chat", "--max-tokens", "12", stdin="Hi\nWhat is 2+2?\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Ctrl-D" in r.stderr  # the banner goes to stderr, not into the transcript
    # stdout: "> reply 1\n> reply 2\n> " (input() writes the prompt; the last one meets EOF)
    assert r.stdout.count("> ") == 3 and r.stdout.endswith("> ")
    replies = [line.removeprefix("> ") for line in r.stdout.split("\n")[:-1]]
    assert len(replies) == 2 and all(reply.strip() for reply in replies), r.stdout
    assert "4" in replies[1]


def test_generate_into_a_closed_pipe_ends_quietly():
    """`ketch generate ... | head -c 1`: the reader is gone (here before the first write), so the
    write fails with EPIPE; the command ends as SIGPIPE would (141), without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "ketch.cli", "generate", "Hello", "--max-tokens", "4",
                             "--num-threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    proc.stdout.close()  # no reader left
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err[-2000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]


def test_chat_forgets_its_oldest_exchange_when_the_context_is_full():
    """With a 96-token context the third message no longer fits with the first two exchanges:
    the oldest is forgotten and the session goes on (it ended with exit 2 before); a message that
    cannot fit even alone is an error for that message only."""
    r = ketch("chat", "--max-tokens", "12", "--max-model-len", "96",
              stdin="Hi\nWhat is 2+2?\nName a color.\n" + "word " * 200 + "\nName a fruit.\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "oldest exchange is forgotten" in r.stderr and "error: " in r.stderr
    replies = [line for line in r.stdout.split("\n") if line.strip("> ")]
    assert len(replies) == 4, r.stdout  # every message but the one too long for the context


def test_bad_flag_value_exits_2_naming_the_field():
    r = ketch("generate", "Hello", "--max-tokens", "0")
    assert r.returncode == 2
    assert "max_tokens" in r.stderr and "error" in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("flags, flag", [(["--repeat", "0"], "--repeat"), (["--batch-sizes", "0"], "--batch-sizes"),
                                         (["--batch-sizes", "1,x"], "--batch-sizes"), (["--input-len", "0"], "--input-len"),
                                         (["--output-file", "/nonexistent-dir/x.json"], "--output-file"),
                                         (["--output-file", "."], "--output-file")])
def test_bench_offline_refuses_bad_flags_before_running(flags, flag):
    """Refused by the parser, naming the flag (they were an IndexError after loading the model, a
    message naming another field, or a results file lost at the end of the whole run)."""
    r = ketch("bench", "offline", "--input-len", "8", "--output-len", "2", "--batch-sizes", "1", *flags)
    assert r.returncode == 2 and f"argument {flag}" in r.stderr, r.stderr[-2000:]
    assert "Loading weights" not in r.stderr


def test_bench_offline_refuses_a_shared_prefix_past_the_prompt_before_loading_the_model():
    """Checked before the engine is built (it was refused only after the model had loaded): with
    a model path that does not exist, the error is still the prefix's."""
    r = ketch("bench", "offline", "--input-len", "8", "--shared-prefix-len", "8", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "shared_prefix_len" in r.stderr, r.stderr[-2000:]
    assert "nonexistent" not in r.stderr


@pytest.mark.parametrize("command", [["one-batch", "--output-len", "2"], ["one-batch", "--profile"],
                                     ["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]],
                         ids=["one-batch", "one-batch-profile", "serve"])
@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_every_bench_refuses_a_results_path_it_could_not_write(tmp_path, command, where):
    """A results file (or trace) that cannot be written is refused when the flags are parsed,
    naming the flag: it was a traceback after the whole run, its results lost (one-batch, serve;
    and offline with a folder)."""
    path = str(tmp_path / "no" / "x.json") if where == "missing-folder" else str(tmp_path)
    flag = command[-1] if command[-1] == "--profile" else "--output-file"
    args = command + [path] if flag == "--profile" else command + ["--output-file", path]
    r = ketch("bench", *args)
    assert r.returncode == 2 and f"argument {flag}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Loading weights" not in r.stderr


def test_bench_serve_names_its_tokenizer_flag_for_a_missing_path():
    r = subprocess.run([sys.executable, "-m", "ketch.cli", "bench", "serve", "--tokenizer", "/nonexistent/tok",
                        "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "tokenizer: path '/nonexistent/tok' does not exist" in r.stderr, r.stderr[-2000:]
    assert "model" not in r.stderr


def test_bench_offline_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = ketch("bench", "offline", "--input-len", "16", "--output-len", "8", "--batch-sizes", "1,2",
              "--output-file", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    results = data["results"]
    assert [res["batch"] for res in results] == [1, 2]
    for res in results:
        assert res["input_len"] == 16 and res["output_len"] == 8
        for key in ("total_s", "mean_ttft_ms", "request_s", "input_tok_s", "output_tok_s", "total_tok_s",
                    "decode_tok_s", "decode_tok_s_per_request"):
            assert isinstance(res[key], (int, float)) and res[key] > 0, (key, res)
        # every request ran to length (ignore_eos): output throughput accounts for batch * 8 tokens
        assert abs(res["output_tok_s"] * res["total_s"] - res["batch"] * 8) <= 0.1 * res["batch"] * 8
    assert data["meta"]["threads"] == 1
    assert "batch    1 | in 16 out 8" in r.stdout and "batch    2 | in 16 out 8" in r.stdout


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (from /proc: field 5 of stat)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def _serve_that_fails(*flags: str, env: dict | None = None) -> tuple[int, str]:
    """`ketch serve` expected to exit during start-up: (its exit code, its stderr), once every
    process of its group (the engine joins it) has ended."""
    proc = subprocess.Popen([sys.executable, "-m", "ketch.cli", "serve", "--port", "0", "--num-threads", "1", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)  # a group of its own
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # multiprocessing's resource tracker ends on its own once its parent is gone: a short wait
    wait_for(lambda: _group_members(proc.pid) == [], "every process of the server to end", deadline_s=20)
    return proc.returncode, err


def test_serve_on_a_port_in_use_exits_2_before_the_model_loads():
    """The socket is bound before the engine starts: a taken port is an error naming it at once
    (it was uvicorn's exit 3 after the whole load, with "serving ... on" already printed)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, err = _serve_that_fails("--port", str(taken.getsockname()[1]))
    assert code == 2, err[-2000:]
    assert "error: port: cannot bind" in err and "Loading weights" not in err


def test_a_prefill_server_whose_bootstrap_port_is_its_http_port_exits_2_before_the_model_loads():
    """The engine's bootstrap socket bound and listened on the port the HTTP socket had bound but
    not yet listened on: the server said "serving ... on" that port and answered every client with
    the bootstrap socket's bytes, for good."""
    port = free_port()
    code, err = _serve_that_fails("--port", str(port), "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(port))
    assert code == 2, err[-2000:]
    assert "error: disaggregation_bootstrap_port: " in err and "Loading weights" not in err, err[-2000:]


def test_serve_whose_port_another_socket_took_during_the_load_exits_2_without_serving():
    """The same clash where the two hosts are spelt differently (localhost, 127.0.0.1), so that only
    the listen() finds it: one line naming the port and exit 2 (it served nothing, and never ended)."""
    port = free_port()
    code, err = _serve_that_fails("--host", "localhost", "--port", str(port), "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-host", "127.0.0.1", "--disaggregation-bootstrap-port",
                                  str(port))
    assert code == 2, err[-2000:]
    assert "error: port: cannot listen on localhost" in err, err[-2000:]


@pytest.mark.parametrize("flags, field", [(["--port", "83736"], "port"), (["--port", "-1"], "port"),
                                          (["--shutdown-timeout", "nan"], "shutdown_timeout")])
def test_serve_refuses_a_port_or_deadline_out_of_range(flags, field):
    """83736 was bound as 18200 (mod 65536) while the log said 83736; a nan deadline crashed the
    SIGTERM handler."""
    r = ketch("serve", *flags)
    assert r.returncode == 2 and f"error: {field}: must be" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("flags, field", [(["--max-model-len", "100000000"], "max_model_len"),
                                          (["--device", "cuda"], "device")])
def test_serve_refuses_a_setting_the_engine_build_refuses_in_one_line(flags, field):
    """The engine process builds the engine; a setting its build refuses (a ValueError naming it) was
    a 25-line traceback and exit 1 there, where `ketch generate` says one line and exits 2."""
    import torch

    if field == "device" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = ketch("serve", "--port", "0", *flags)
    assert r.returncode == 2 and f"error: {field}: " in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "ValueError" not in r.stderr, r.stderr[-2000:]


def test_serve_with_a_tokenizer_that_cannot_load_exits_2_and_ends_its_engine(tmp_path):
    """`ketch serve` starts the engine process before it loads the tokenizer (the two overlap):
    a tokenizer that fails still exits 2 naming the field, and the engine it started is gone."""
    code, err = _serve_that_fails("--tokenizer", str(tmp_path))
    assert code == 2, err[-2000:]
    assert "error: tokenizer" in err


def test_ketch_gateway_never_imports_torch():
    """The gateway is a proxy: parsing its flags and building its app load no torch (~1.3 s and
    ~300 MB a process); nor does the whole parser, `ketch serve`'s flags included (their config
    is the engine's, which imports torch in its own process: tests/test_serve_startup.py)."""
    probe = ("import sys; from ketch import cli; "
             "cli._gateway_parser().parse_args(['gateway', '--worker-urls', 'http://127.0.0.1:9']); "
             "import ketch.gateway.serve, ketch.gateway.app; light = 'torch' not in sys.modules; "
             "cli.build_parser(); print(light, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "False"]  # none for the gateway, none for the full parser


def test_serve_whose_engine_cannot_import_exits_1_saying_why(tmp_path):
    """A broken install (here: a sitecustomize that makes `ketch.engine.engine` fail to import, in
    every process of the server) ends `ketch serve` with exit 1 and the import error's text: the
    engine process reports it once its sockets exist, not only its exit code."""
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class Broken(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ketch.engine.engine':\n"
        "            raise ImportError('planted: the engine module is broken')\n"
        "sys.meta_path.insert(0, Broken())\n")
    code, err = _serve_that_fails(env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert code == 1, err[-2000:]
    assert "error: ImportError: planted: the engine module is broken" in err
