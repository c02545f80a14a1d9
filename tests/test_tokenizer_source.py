"""A tokenizer from somewhere else than the model (`--tokenizer`): real text from dummy weights, so
that an 8B-shaped random model can be served and benchmarked end to end; the fast decode path;
and joining a sample's queued token deltas (several tokens per frame for a client that fell behind)."""
from __future__ import annotations

import json
import random

import pytest
from server_util import running_server

from ketch import LLM, SamplingParams
from ketch.engine.messages import TokenDelta, WireLogprob
from ketch.server.client import EngineGone
from ketch.server.generation import coalesce
from ketch.text.tokenizer import Tokenizer
from ketch.weights.source import default_model_path

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny49k")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def test_fast_decode_equals_transformers_decode():
    tok = Tokenizer.load()
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip), ids


def test_dummy_weights_with_a_real_tokenizer_make_text(tiny_dir):
    llm = LLM(tiny_dir, load_format="dummy", tokenizer=default_model_path(), dtype="float32", device="cpu")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.text == llm.tokenizer.decode(out.token_ids)
    assert out.text.strip()  # random weights, real words
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(tiny_dir, load_format="dummy", tokenizer="/no/such/file.gguf")


def test_serve_a_dummy_model_with_a_real_tokenizer(tiny_dir):
    import openai

    with running_server("--model", tiny_dir, "--load-format", "dummy", "--tokenizer", default_model_path()) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Say something."}]
        whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 24 and whole.choices[0].message.content
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content


def _delta(rid: str, index: int, ids: list[int], finished: bool = False, logprob: bool = False) -> TokenDelta:
    lps = [WireLogprob(t, -float(t)) for t in ids] if logprob else None
    return TokenDelta(rid, index, ids, lps, finished, "length" if finished else None, None, 3, 0)


def test_coalesce_joins_each_samples_deltas_in_order():
    gone = EngineGone("x")
    items = [_delta("r", 0, [1], logprob=True), _delta("r", 1, [7]), _delta("r", 0, [2], logprob=True),
             _delta("r", 1, [8]), gone, _delta("r", 0, [3]), _delta("r", 0, [4], finished=True), _delta("r", 0, [9])]
    out = coalesce(items)
    assert [type(o).__name__ for o in out] == ["TokenDelta", "TokenDelta", "EngineGone", "TokenDelta", "TokenDelta"]
    assert (out[0].index, out[0].new_token_ids, [lp.token_id for lp in out[0].new_logprobs]) == (0, [1, 2], [1, 2])
    assert (out[1].index, out[1].new_token_ids, out[1].new_logprobs) == (1, [7, 8], None)
    assert out[2] is gone  # nothing crosses an exception
    assert (out[3].new_token_ids, out[3].finished, out[3].finish_reason) == ([3, 4], True, "length")
    assert out[4].new_token_ids == [9]  # nothing joins a delta that finished
    assert [t for o in out if isinstance(o, TokenDelta) for t in o.new_token_ids] == [1, 2, 7, 8, 3, 4, 9]


def test_coalesce_keeps_a_pd_first_deltas_ttft_split():
    import msgspec
    first = msgspec.structs.replace(_delta("r", 0, [5]), pd_timing=(0.04, 0.006, 0.05, 0.002))
    out = coalesce([first, _delta("r", 0, [6]), _delta("r", 0, [7], finished=True)])
    assert len(out) == 1 and out[0].new_token_ids == [5, 6, 7] and out[0].pd_timing == (0.04, 0.006, 0.05, 0.002)
