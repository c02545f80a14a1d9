"""Resuming a stream through `ketch serve` (issue 16), as the gateway will: stream with
`return_token_ids`, cut the stream after some chunks, send the same body again with
`"resume": {"generated_token_ids": <the ids so far>}`, and join. The joined text and ids equal the
uncut stream's, for completions and chat, greedy and seeded, across a stop string that spans the
cut; usage adds up; a bad `resume` is a 400 naming it. One real server for the module."""
from __future__ import annotations

import json

import pytest
from server_util import connect, metrics, pages_all_back, post, running_server, wait_for

PROMPT = "Once upon a time, in a small village by the sea,"
STORY = [{"role": "user", "content": "Tell me a very short story about a cat."}]
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def server():
    with running_server() as running:
        yield running


def sse(base: str, path: str, body: dict) -> list[dict]:
    """A streamed request's events (chunks), [DONE] excluded."""
    conn = connect(base, timeout=300)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return events
            event = json.loads(data)
            assert "error" not in event, event
            events.append(event)
        raise AssertionError("the stream ended without [DONE]")
    finally:
        conn.close()


def choices(events: list[dict]) -> list[dict]:
    return [c for e in events for c in e["choices"]]


def text_of(choice: dict) -> str:
    return choice["text"] if "text" in choice else (choice["delta"].get("content") or "")


def usage(events: list[dict]) -> dict:
    return events[-1]["usage"]


def cut_and_resume(base: str, path: str, body: dict, cuts: tuple[int, ...], regenerate: bool = False) -> list[int]:
    """The uncut stream, then for each cut c: the chunks up to the one that brings the c-th id (a
    slow reader may get several ids per chunk), as the client had them, resumed. `regenerate`:
    as the gateway resumes, with the last chunk's ids made again silently (regenerate_last)."""
    body = {**body, "return_token_ids": True, "stream_options": {"include_usage": True}}
    whole = sse(base, path, body)
    parts = [c for c in choices(whole) if c.get("token_ids") or text_of(c) or c["finish_reason"]]
    whole_ids = [t for c in parts for t in c["token_ids"]]
    whole_text = "".join(text_of(c) for c in parts)
    reason = next(c["finish_reason"] for c in parts if c["finish_reason"])
    ends = [sum(len(c["token_ids"]) for c in parts[: i + 1]) for i in range(len(parts))]
    for cut in cuts:
        upto = next(i for i, end in enumerate(ends) if end >= cut) + 1
        sent_ids = [t for c in parts[:upto] for t in c["token_ids"]]
        sent_text = "".join(text_of(c) for c in parts[:upto])
        assert 0 < len(sent_ids) < len(whole_ids), cut
        m = len(parts[upto - 1]["token_ids"]) if regenerate else 0
        resumed = sse(base, path, {**body, "resume": {"generated_token_ids": sent_ids, "regenerate_last": m}})
        rest = choices(resumed)
        assert "role" not in rest[0].get("delta", {}), "a resumed chat stream has no second role chunk"
        assert sent_text + "".join(text_of(c) for c in rest) == whole_text, cut
        assert sent_ids + [t for c in rest for t in c["token_ids"]] == whole_ids, cut
        assert [c["finish_reason"] for c in rest if c["finish_reason"]] == [reason]
        # usage: the original prompt; completion tokens are this stream's (the gateway adds the ids it sent)
        u, w = usage(resumed), usage(whole)
        assert u["prompt_tokens"] == w["prompt_tokens"]
        assert u["completion_tokens"] == w["completion_tokens"] - len(sent_ids) + m
        assert u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    wait_for(lambda: pages_all_back(metrics(base)), "every page back")
    return whole_ids


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5,
                                                            "frequency_penalty": 0.5, "min_tokens": 20}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("regenerate", [False, True], ids=["prefilled", "regenerated"])
def test_completions_stream_resumed(server, sampling, regenerate):
    _, base = server
    ids = cut_and_resume(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, **sampling}, (1, 7, 23),
                         regenerate)
    assert len(ids) == 24 and len(set(ids)) > 5


@pytest.mark.parametrize("regenerate", [False, True], ids=["prefilled", "regenerated"])
def test_chat_stream_resumed(server, regenerate):
    _, base = server
    body = {"messages": STORY, "max_tokens": 20, "temperature": 0.8, "seed": 9}
    cut_and_resume(base, "/v1/chat/completions", body, (2, 12), regenerate)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": 6}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 64}),
], ids=["chat-length", "completions-length", "chat-eos"])
def test_a_finishing_chunk_regenerated_ends_the_stream(server, path, body):
    """The gateway's uncertain case: the client has the chunk with the last ids, maybe not the finish
    (a chat stream sends it in a chunk of its own). Regenerating those ids silently ends the stream
    with the original's finish and nothing else: no text, no ids; usage counts them."""
    _, base = server
    body = {**body, "temperature": 0, "return_token_ids": True, "stream_options": {"include_usage": True}}
    whole = sse(base, path, body)
    parts = [c for c in choices(whole) if c.get("token_ids")]
    ids = [t for c in parts for t in c["token_ids"]]
    reason = next(c["finish_reason"] for c in choices(whole) if c["finish_reason"])
    m = len(parts[-1]["token_ids"])
    resumed = sse(base, path, {**body, "resume": {"generated_token_ids": ids, "regenerate_last": m}})
    assert [(text_of(c), c["token_ids"], c["finish_reason"]) for c in choices(resumed)] == [("", [], reason)]
    assert usage(resumed)["completion_tokens"] == m
    if "eos" in path or body["max_tokens"] == 64:
        assert reason == "stop" and ids[-1] == EOS


def test_a_regenerated_id_that_differs_ends_the_stream_with_an_error(server):
    _, base = server
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    ids = [t for c in choices(sse(base, "/v1/completions", body)) for t in c["token_ids"]]
    wrong = ids[:3] + [(ids[3] + 1) % 49152]
    conn = connect(base, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True, "resume": {
            "generated_token_ids": wrong, "regenerate_last": 1}}), {"content-type": "application/json"})
        events = [json.loads(line[6:]) for line in conn.getresponse() if line.startswith(b"data: {")]
    finally:
        conn.close()
    assert events[-1]["error"]["code"] == "resume_diverged", events
    assert not any(e.get("choices") for e in events)  # nothing of a forked text went out
    wait_for(lambda: pages_all_back(metrics(base)), "every page back")


def test_a_stop_string_spanning_the_cut(server):
    """Cut right after the token that starts a stop string: the original had held that start back;
    the resumed stream holds it too, stops on the next token, and the joined text ends before it."""
    _, base = server
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    # a stop string that never matches: with one, each chunk is one token (generation.py joins the
    # queued deltas of a slow reader only without stop strings), which the indexing below needs
    whole = choices(sse(base, "/v1/completions", {**body, "stop": ["\u0000"]}))
    text = "".join(c["text"] for c in whole)
    k = next(i for i in range(4, len(whole) - 1) if len(whole[i]["text"]) >= 3 and len(whole[i + 1]["text"]) >= 3)
    stop = whole[k]["text"][-2:] + whole[k + 1]["text"][:2]
    assert text.find(stop) == len("".join(c["text"] for c in whole[: k + 1])) - 2
    stopped = choices(sse(base, "/v1/completions", {**body, "stop": [stop]}))
    sent = stopped[: k + 1]  # the chunks up to the token that starts the stop string
    assert not "".join(c["text"] for c in sent).endswith(stop[:2])  # held back
    resumed = choices(sse(base, "/v1/completions", {**body, "stop": [stop], "resume": {
        "generated_token_ids": [t for c in sent for t in c["token_ids"]]}}))
    assert "".join(c["text"] for c in sent + resumed) == text[: text.index(stop)]
    assert resumed[-1]["finish_reason"] == "stop" and resumed[-1]["matched_stop"] == stop


def test_logprob_offsets_go_on(server):
    _, base = server
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    whole = choices(sse(base, "/v1/completions", body))
    ids = [t for c in whole for t in c["token_ids"]]
    offsets = [o for c in whole if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    resumed = choices(sse(base, "/v1/completions", {**body, "resume": {"generated_token_ids": ids[:6]}}))
    assert [o for c in resumed if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets[6:]


@pytest.mark.parametrize("change, param, words", [
    ({"resume": {"generated_token_ids": [1, 49152]}}, "resume.generated_token_ids", "must be in [0, 49152)"),
    ({"resume": {"generated_token_ids": "12"}}, "resume.generated_token_ids", "a list of token ids"),
    ({"resume": {"generated_token_ids": [1, True]}}, "resume.generated_token_ids", "a list of token ids"),
    ({"resume": {"ids": [1]}}, "resume", "unsupported field 'ids'"),
    ({"resume": [1]}, "resume", "expected dict"),
    ({"resume": {"generated_token_ids": [1, 2, 3, 4]}}, "resume.generated_token_ids", "max_tokens (4) counts them"),
    ({"resume": {"generated_token_ids": [7, EOS, 7]}}, "resume.generated_token_ids", "token 1 (2) is a stop token"),
    ({"n": 2, "resume": {"generated_token_ids": [7]}}, "resume.generated_token_ids", "one sample at a time"),
    ({"prompt": ["a", "b"], "resume": {"generated_token_ids": [7]}}, "resume", "one prompt's stream, got 2"),
    ({"stream": False, "resume": {"generated_token_ids": [7]}}, "resume", "needs stream=true"),
    ({"resume": {"generated_token_ids": [7], "regenerate_last": 2}}, "resume.regenerate_last", "from 0 to the number"),
    ({"resume": {"generated_token_ids": [7], "regenerate_last": "1"}}, "resume.regenerate_last", "an integer"),
])
def test_bad_resume_is_a_400_naming_the_field(server, change, param, words):
    _, base = server
    status, body = post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_a_resumed_text_with_a_stop_string_is_a_400(server):
    """The original stream would have stopped inside the ids: nothing to resume."""
    _, base = server
    first = choices(sse(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                  "return_token_ids": True}))
    ids = [t for c in first for t in c["token_ids"]]
    stop = "".join(c["text"] for c in first).strip()[:3]
    status, body = post(base, "/v1/chat/completions", {
        "messages": STORY, "max_tokens": 16, "stream": True, "stop": [stop], "resume": {"generated_token_ids": ids}})
    assert status == 400 and body["error"]["param"] == "resume.generated_token_ids", body
    assert f"contains the stop string {stop!r}" in body["error"]["message"]
