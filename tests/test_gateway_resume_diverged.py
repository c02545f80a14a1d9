"""A stream's continuation that cannot be exact (`resume_diverged`), for real: the stream runs on
the bundled SmolLM2 replica, which is SIGKILLed mid-stream; the only other worker serves another
model under the same name (a random one with SmolLM2's tokenizer and vocabulary), so it makes the
client's last chunk of tokens otherwise and answers `resume_diverged`, as a bf16 worker may at a
near-tie. The gateway must not hand that answer (an invalid_request_error about a body the client
never sent) to the client, nor count the stream as resumed, nor blame the healthy worker: the
client gets one `worker_lost` event saying why, then [DONE]."""
from __future__ import annotations

import json

from gateway_util import MODEL, request, running_gateway, sigkill_replica, start_replica, stop, wait_healthy, workers
from server_util import free_port, parse_metrics, wait_for
from test_gateway_faults import stream_events

from ketch.weights.source import default_model_path

BODY = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
IMPOSTOR = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": True}


def test_a_continuation_that_diverges_is_dropped_and_the_stream_ends_with_worker_lost(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(IMPOSTOR))
    real = start_replica(free_port())
    impostor = start_replica(free_port(), "--model", str(tmp_path / "config.json"), "--load-format", "dummy",
                             "--tokenizer", default_model_path(), "--served-model-name", MODEL)
    try:
        wait_healthy(real)
        wait_healthy(impostor)
        with running_gateway("--worker-urls", real.url, "--health-check-interval-secs", "0.5") as (_, base):
            wait_for(lambda: workers(base)[real.url]["available"], "the gateway to use the replica", 20)
            status, _, answer = request(base, "POST", "/workers", {"url": impostor.url})
            assert status == 201, answer

            def kill_the_real_one(resp) -> None:
                assert resp.getheader("x-ketch-worker") == real.url  # registered first, idle: the stream's
                sigkill_replica(real)

            events = stream_events(base, BODY, kill_the_real_one)
            errors = [e["error"] for e in events if "error" in e]
            assert len(errors) == 1 and "error" in events[-1], events[-3:]
            assert errors[0]["code"] == "worker_lost" and errors[0]["type"] == "service_unavailable"
            assert f"{impostor.url} could not continue it exactly (resume_diverged)" in errors[0]["message"]
            assert {e["id"] for e in events[:-1]} == {events[0]["id"]}  # the real worker's part, whole

            m = parse_metrics(request(base, "GET", "/metrics")[2].decode())
            assert m["ketch_gateway_failover_diverged_total"] == 1
            assert m['ketch_gateway_failovers_total{outcome="gave_up"}'] == 1
            assert m.get('ketch_gateway_failovers_total{outcome="resumed"}', 0) == 0
            assert not any(k.startswith("ketch_gateway_worker_errors_total") and impostor.url in k for k in m), m
            assert workers(base)[impostor.url]["available"]  # healthy, not charged: it still serves
            status, _, answer = request(base, "POST", "/v1/completions", {**BODY, "max_tokens": 2})
            assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
    finally:
        stop(real.proc)
        stop(impostor.proc)
