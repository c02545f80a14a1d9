"""POST /v1/chat/completions: messages → chat template → tokens → engine → OpenAI chat shapes.

Each choice's text goes through a ChatOutputParser (one state machine for stream and whole; with
no tool or reasoning parser it passes text through): `reasoning_content`, `content` and
`tool_calls` come out of it, and so does the finish reason: "tool_calls" for a choice that called
tools and stopped, "length" when max_tokens cut it, even inside a call (both paths then report that
call alike, with the arguments read so far).
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ketch.sampling.grammar.spec import GrammarSpec
from ketch.server.client import new_request_id
from ketch.server.errors import APIError, bad_value
from ketch.server.generation import Generation, check_context
from ketch.server.pd import bootstrap_of
from ketch.server.logprobs import chat_logprobs
from ketch.server.protocol import CHAT_FIELDS, check_fields, resume_token_ids, sampling_params
from ketch.server.disconnect import unless_disconnected
from ketch.server.encoding import on_encoder_thread, refuse_unfitting
from ketch.server.sse import GenerationStream
from ketch.server.state import ServerState
from ketch.server.structured import grammar_spec, off_the_loop
from ketch.server.tools import ChatPlan, plan_chat


def encode_messages(state: ServerState, messages: Any, template_kwargs: dict[str, Any] | None = None,
                    fit_in: int | None = None) -> list[int]:
    """Chat template + tokenizer: the prompt ids of a conversation (also used by /tokenize); a
    rendered prompt whose length alone shows it has fit_in tokens or more is a 400 untokenized.
    CPU work in proportion to the text: callers run it on an encoding thread (encoding.py)."""
    tok = state.require_tokenizer("messages")
    if state.chat_template is None:
        raise APIError(400, "messages: the model has no chat template; start the server with --chat-template",
                       param="messages")
    try:
        text = state.chat_template.render(messages, add_generation_prompt=True, bos_token=tok.bos_token,
                                          eos_token=tok.eos_token, **(template_kwargs or {}))
    except ValueError as e:
        raise bad_value(e) from None
    refuse_unfitting(tok, text, fit_in, "messages")
    return tok.encode(text, add_special_tokens=False)


async def chat_completions(state: ServerState, body: Any, request: Request):
    fields = check_fields(body, CHAT_FIELDS)
    state.check_model(fields.get("model"))
    if "messages" not in fields:
        raise APIError(400, "messages: required", param="messages")
    def planned() -> tuple[ChatPlan, GrammarSpec | None]:
        plan = plan_chat(fields, state.chat_template.source if state.chat_template else None,
                         state.tool_call_parser, state.reasoning_parser)
        return plan, plan.grammar(*grammar_spec(fields))

    plan, grammar = await off_the_loop(fields, planned)
    ready = state.client.ready
    prompt_ids = await on_encoder_thread(
        lambda: encode_messages(state, plan.messages, plan.template_kwargs, ready.max_model_len))
    params = sampling_params(fields, min(ready.max_model_len, ready.kv_capacity_tokens) - len(prompt_ids), grammar,
                             state.max_n)
    params = plan.adjust(params, fields)
    generated, replay = resume_token_ids(fields) or (None, None)
    check_context(prompt_ids, params, state.client, "messages", generated, fields)
    bootstrap = bootstrap_of(fields, state.client.config.disaggregation_mode, params, 1, generated)
    rid = new_request_id("chatcmpl")
    gen = Generation(state, rid, [prompt_ids], params, fields.get("timeout"), generated, replay, bootstrap,
                     plan.answer_end)
    gen.start()
    head = {"id": rid, "created": int(time.time()), "model": state.model_name}
    with_ids = bool(fields.get("return_token_ids"))
    if fields.get("stream"):
        usage = bool((fields.get("stream_options") or {}).get("include_usage"))
        return GenerationStream(gen, lambda g: _chunks(state, g, head, usage, plan, with_ids))
    try:
        return await unless_disconnected(request, _whole(state, gen, head, plan, with_ids))
    finally:
        gen.close()


async def _whole(state: ServerState, gen: Generation, head: dict, plan: ChatPlan, with_ids: bool) -> JSONResponse:
    params = gen.params
    texts = [""] * params.n
    choices = [{"index": i, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "matched_stop": None, **({"token_ids": []} if with_ids else {})}
               for i in range(params.n)]
    async for ev in gen.events():
        c = choices[ev.index]
        texts[ev.index] += ev.text
        if with_ids:
            c["token_ids"] += ev.token_ids
        if params.wants_logprobs:
            c["logprobs"] = c["logprobs"] or {"content": []}
            c["logprobs"]["content"] += chat_logprobs(state.tokenizer, ev.logprobs)["content"]
        if ev.finish_reason is not None:
            c["finish_reason"], c["matched_stop"] = ev.finish_reason, ev.matched_stop
    for c, text in zip(choices, texts):
        parser = plan.output_parser()
        parser.feed(text)
        parser.finish()
        c["message"] = {k: v for k, v in parser.message().items() if v is not None or k == "content"}
        c["finish_reason"] = parser.finish_reason(c["finish_reason"])
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": gen.usage.as_dict()})


async def _chunks(state: ServerState, gen: Generation, head: dict, include_usage: bool,
                  plan: ChatPlan, with_ids: bool) -> AsyncIterator[dict]:
    def chunk(choices: list[dict]) -> dict:
        out = {**head, "object": "chat.completion.chunk", "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    parsers = [plan.output_parser() for _ in range(gen.params.n)]
    roles = []
    if gen.generated is not None:
        # A resumed stream: its client has the role chunk and what the parser made of the text so
        # far; the parser takes that text (its deltas were sent) so it goes on from the same state.
        parsers[0].feed(gen.resumed_text)
    else:
        roles = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]) for i in range(gen.params.n)]
    if gen.bootstrap is None:
        for role in roles:
            yield role
        roles = []
    # PD: the role chunks wait for the first token, i.e. for the KV to have arrived. A gateway races
    # the prefill against the decode answer's first bytes: a prefill that fails before the KV came
    # must still be able to answer the client, which a stream that had begun would not let it.
    async for ev in gen.events():
        for role in roles:
            yield role
        roles = []
        parser = parsers[ev.index]
        if ev.silent_text:
            parser.feed(ev.silent_text)  # its deltas reached the client from the original stream
        logprobs = chat_logprobs(state.tokenizer, ev.logprobs) if gen.params.wants_logprobs else None
        ids = ev.token_ids if with_ids else None  # on the event's first chunk; a gateway resumes from them
        deltas = [parser.feed(ev.text) if ev.text else None]
        if ev.finish_reason is not None:
            deltas.append(parser.finish())
        for delta in deltas:
            if delta or logprobs or ids:
                choice = {"index": ev.index, "delta": delta or {}, "logprobs": logprobs, "finish_reason": None}
                yield chunk([{**choice, "token_ids": ids} if with_ids else choice])
                logprobs, ids = None, []
        if ev.finish_reason is not None:
            last = {"index": ev.index, "delta": {}, "logprobs": None,
                    "finish_reason": parser.finish_reason(ev.finish_reason), "matched_stop": ev.matched_stop}
            yield chunk([{**last, "token_ids": []} if with_ids else last])
    if include_usage:
        yield {**head, "object": "chat.completion.chunk", "choices": [], "usage": gen.usage.as_dict()}
