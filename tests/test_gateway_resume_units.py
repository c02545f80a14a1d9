"""The gateway's side of mid-stream failover without processes: what the client has (read from the
relayed events), the request that continues it, and the continuing worker's events rewritten
(ketch/gateway/resume.py, sse.py, routed.py)."""
from __future__ import annotations

import json

from ketch.gateway.resume import Continuation, continuation, read_so_far
from ketch.gateway.routed import routed_request
from ketch.gateway.sse import payloads, strip_token_ids


def ev(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def chat(delta: dict, ids: list[int], finish: str | None = None, cid: str = "chatcmpl-a") -> bytes:
    return ev({"id": cid, "created": 7, "object": "chat.completion.chunk",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": ids}]})


def test_strip_token_ids_removes_only_the_field():
    block = chat({"content": 'a, "token_ids": [1]'}, [5, 6]) + b"data: [DONE]\n\n"
    out = strip_token_ids(block)
    event = json.loads(payloads(out)[0])
    assert "token_ids" not in event["choices"][0]
    assert event["choices"][0]["delta"]["content"] == 'a, "token_ids": [1]'  # text that looks like it stays
    assert payloads(out)[1] == b"[DONE]"


def test_read_so_far_counts_the_chunks_after_the_last_ids():
    role = chat({"role": "assistant", "content": ""}, [])
    blocks = [role + chat({"content": "Hi"}, [10, 11]), chat({"content": " there"}, [12]),
              chat({"content": "!"}, []) + chat({}, [], "stop")]
    so = read_so_far(blocks)
    assert (so.id, so.created, so.sent_any, so.ids, so.last_ids, so.after) == ("chatcmpl-a", 7, True, [10, 11, 12], 1, 2)
    # completions: the finish comes with the last ids, and counts as one chunk after them
    done = ev({"id": "cmpl-b", "created": 1, "choices": [{"index": 0, "text": ".", "finish_reason": "length",
                                                         "token_ids": [4]}]})
    assert (read_so_far([done]).last_ids, read_so_far([done]).after) == (1, 1)
    assert read_so_far([role]).sent_any and read_so_far([role]).ids == []
    assert not read_so_far([]).sent_any


def test_the_continuation_regenerates_the_last_chunk_and_drops_what_the_client_has():
    fields = {"messages": [{"role": "user", "content": "x"}], "stream": True, "seed": 3, "return_token_ids": True}
    so = read_so_far([chat({"content": "Hi"}, [10, 11]), chat({"content": " there"}, [12, 13]), chat({}, [], "length")])
    plan = continuation(fields, so)
    assert json.loads(plan.body) == {**fields, "resume": {"generated_token_ids": [10, 11, 12, 13], "regenerate_last": 2}}
    assert (plan.prefilled, plan.drop) == (2, 1)
    usage = ev({"id": "chatcmpl-z", "created": 99, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2,
                                                                           "total_tokens": 7}})
    kept, sent = Continuation(so, plan, strip_ids=True)(chat({}, [], "length", cid="chatcmpl-z") + usage
                                                        + b"data: [DONE]\n\n")
    sent_events = [json.loads(p) for p in payloads(sent)[:-1]]
    assert sent_events == [{"id": "chatcmpl-a", "created": 7, "choices": [],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}}]
    assert payloads(sent)[-1] == payloads(kept)[-1] == b"[DONE]"


def test_the_continuation_of_a_stream_with_no_token_yet():
    fields = {"prompt": "x", "stream": True, "seed": 1, "return_token_ids": True}
    assert "resume" not in json.loads(continuation(fields, read_so_far([])).body)  # nothing sent: start again
    role = chat({"role": "assistant", "content": ""}, [])
    plan = continuation(fields, read_so_far([role]))  # the role chunk is out: resume from no id, no second one
    assert json.loads(plan.body)["resume"] == {"generated_token_ids": []} and (plan.prefilled, plan.drop) == (0, 0)


def test_kept_events_keep_the_ids_and_sent_ones_lose_them_unless_asked():
    so = read_so_far([chat({"content": "a"}, [1])])
    plan = continuation({"stream": True}, so)
    block = chat({"content": "b"}, [2], cid="other")
    kept, sent = Continuation(so, plan, strip_ids=True)(block)
    assert json.loads(payloads(kept)[0])["choices"][0]["token_ids"] == [2]
    assert "token_ids" not in json.loads(payloads(sent)[0])["choices"][0]
    assert json.loads(payloads(sent)[0])["id"] == "chatcmpl-a"
    _, sent = Continuation(so, plan, strip_ids=False)(block)
    assert json.loads(payloads(sent)[0])["choices"][0]["token_ids"] == [2]
    assert read_so_far([chat({"content": "a"}, [1]), kept]).ids == [1, 2]  # a second failover reads on


def test_a_held_back_tokens_event_goes_with_its_ids():
    """A token a stop string or a parser holds back comes as a chunk with its ids and nothing else:
    the client that did not ask for ids does not get it, from the first worker or a continuing one;
    every other chunk (a finish, usage, a role) it gets. The kept events still have it (its ids)."""
    held = chat({}, [37])
    cmpl_held = ev({"id": "cmpl-b", "created": 1, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                              "finish_reason": None, "token_ids": [8]}]})
    usage = ev({"id": "chatcmpl-a", "created": 7, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2,
                                                                          "total_tokens": 3}})
    others = [chat({"role": "assistant", "content": ""}, []), chat({"content": "4"}, [36]), chat({}, [], "stop"), usage]
    block = others[0] + others[1] + held + cmpl_held + others[2] + others[3] + b"data: [DONE]\n\n"
    out = [json.loads(p) if p != b"[DONE]" else p for p in payloads(strip_token_ids(block))]
    assert out == [json.loads(strip_token_ids(e)[6:]) for e in others] + [b"[DONE]"]
    assert strip_token_ids(held + cmpl_held) == b""  # a block of such chunks alone: nothing to write
    so = read_so_far([chat({"content": "a"}, [1])])
    kept, sent = Continuation(so, continuation({"stream": True}, so), strip_ids=True)(block)
    assert len(payloads(kept)) == 7 and len(payloads(sent)) == 5
    _, sent = Continuation(so, continuation({"stream": True}, so), strip_ids=False)(block)
    assert len(payloads(sent)) == 7  # the client asked for the ids: every chunk


def test_a_number_json_cannot_spell_again_leaves_the_body_as_it_came():
    body = b'{"prompt": "a", "stream": true, "top_p": 1e400}'
    r = routed_request("completions", body, json.loads(body))
    assert r.fields is None and r.body == body  # not `Infinity`: the worker's 400 names top_p


def test_which_requests_are_resumable_and_how_they_are_sent():
    def routed(route: str, body: dict):
        return routed_request(route, json.dumps(body).encode(), body)

    r = routed("chat", {"messages": [], "stream": True})
    sent = json.loads(r.body)
    assert r.fields == sent and sent["return_token_ids"] is True and isinstance(sent["seed"], int) and r.strip_ids
    assert json.loads(routed("chat", {"messages": [], "stream": True, "seed": 5}).body)["seed"] == 5
    assert not routed("chat", {"messages": [], "stream": True, "return_token_ids": True}).strip_ids
    for body in ({"prompt": "a"}, {"prompt": "a", "stream": True, "n": 2}, {"prompt": ["a", "b"], "stream": True},
                 {"prompt": "a", "stream": True, "resume": {"generated_token_ids": []}},
                 {"prompt": "a", "stream": True, "return_token_ids": "yes"}):
        r = routed("completions", body)
        assert r.fields is None and r.body == json.dumps(body).encode(), body  # forwarded untouched
    for prompt in ("a", [1, 2], [[1, 2]], ["a"]):
        assert routed("completions", {"prompt": prompt, "stream": True}).fields is not None
