"""`ketch serve --tp 2` end to end (CPU, gloo; a tiny dummy-weight model with SmolLM2's
tokenizer): it answers the openai SDK, and a rank that dies takes the server down within
seconds, naming the rank, instead of leaving the other ranks blocked in a collective."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from server_util import gone, running_server

from ketch.weights.source import default_model_path

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32"}
DEATH_DEADLINE_S = 10


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny49k")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def serve_tp2(tiny_dir: str):
    return running_server("--model", tiny_dir, "--load-format", "dummy", "--tokenizer", default_model_path(),
                          "--tp", "2")


def spawned_children(pid: int) -> list[int]:
    """Processes `pid` started through multiprocessing's spawn (not its resource tracker)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue  # exited while we looked
        if ppid == pid and b"spawn_main" in cmdline:
            out.append(int(entry))
    return out


def engine_and_worker(server: subprocess.Popen) -> tuple[int, int]:
    """The engine process (rank 0) and its one worker (rank 1)."""
    [engine] = spawned_children(server.pid)
    [worker] = spawned_children(engine)
    return engine, worker


def test_serve_tp2_answers_the_openai_sdk(tiny_dir):
    import openai

    with serve_tp2(tiny_dir) as (server, base):
        engine_and_worker(server)  # two ranks really run
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say something."}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 16 and whole.choices[0].message.content
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            whole.choices[0].message.content


def test_a_killed_worker_rank_ends_the_server_naming_it(tiny_dir):
    with serve_tp2(tiny_dir) as (server, _):
        engine, worker = engine_and_worker(server)
        os.kill(worker, signal.SIGKILL)
        code = server.wait(timeout=DEATH_DEADLINE_S)
        output = server.stdout.read()
        assert code != 0, output
        assert f"tensor-parallel rank 1 (pid {worker}) exited with code -9" in output, output
        assert gone(engine)


def test_a_killed_engine_process_ends_its_worker(tiny_dir):
    with serve_tp2(tiny_dir) as (server, _):
        engine, worker = engine_and_worker(server)
        os.kill(engine, signal.SIGKILL)
        assert server.wait(timeout=DEATH_DEADLINE_S) != 0
        deadline = time.monotonic() + DEATH_DEADLINE_S
        while not gone(worker):  # the worker notices the broken group, or its parent gone, by itself
            assert time.monotonic() < deadline, "rank 1 outlived rank 0"
            time.sleep(0.1)  # polling interval, not a synchronisation
