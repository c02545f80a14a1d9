"""POST /v1/completions: prompt(s) as text or token ids → engine → OpenAI text_completion shapes."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from ketch.server.client import new_request_id
from ketch.server.errors import APIError
from ketch.server.generation import Generation, check_context
from ketch.server.pd import bootstrap_of
from ketch.server.logprobs import TextOffsets, completion_logprobs
from ketch.server.protocol import COMPLETION_FIELDS, check_fields, completion_prompts, resume_token_ids, sampling_params
from ketch.server.disconnect import unless_disconnected
from ketch.server.encoding import on_encoder_thread, refuse_unfitting
from ketch.server.sse import GenerationStream
from ketch.server.state import ServerState
from ketch.server.structured import grammar_spec, off_the_loop

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _encode(state: ServerState, prompt: str | list[int], max_model_len: int) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    tok = state.require_tokenizer("prompt")
    refuse_unfitting(tok, prompt, max_model_len, "prompt")
    return tok.encode(prompt)


def _check_echo(fields: dict) -> None:
    if fields.get("echo") and fields.get("logprobs") is not None:
        raise APIError(400, "echo: not supported together with logprobs (prompt logprobs are not computed)",
                       param="echo", code="unsupported_field")


async def _echoes(state: ServerState, fields: dict, raw: list[str | list[int]]) -> list[str]:
    """The text `echo` puts before each choice's completion ('' without echo). Called once the
    prompts passed check_context: a token-id prompt's ids are then in the vocabulary (an id the
    tokenizer cannot hold, e.g. -1, made decode raise: a 500) and at most max_model_len long, and
    they are decoded on an encoding thread, not the event loop."""
    if not fields.get("echo"):
        return [""] * len(raw)
    tok = state.require_tokenizer("prompt")

    def texts() -> list[str]:
        return [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in raw]

    return await on_encoder_thread(texts) if any(not isinstance(p, str) for p in raw) else texts()


async def completions(state: ServerState, body: Any, request: Request):
    fields = check_fields(body, COMPLETION_FIELDS)
    state.check_model(fields.get("model"))
    raw = completion_prompts(fields.get("prompt"))
    generated, replay = resume_token_ids(fields) or (None, None)
    if generated is not None and len(raw) != 1:
        raise APIError(400, f"resume: continues one prompt's stream, got {len(raw)} prompts", param="resume")
    _check_echo(fields)
    grammar, _ = await off_the_loop(fields, lambda: grammar_spec(fields))
    params = sampling_params(fields, DEFAULT_MAX_TOKENS, grammar, state.max_n)
    if len(raw) * params.n > state.max_request_samples:  # before any prompt is encoded or sample built
        raise APIError(400, f"prompt: {len(raw)} prompts x n {params.n} = {len(raw) * params.n} samples; this server "
                       f"takes at most {state.max_request_samples} per request (--max-request-samples)",
                       param="prompt")
    max_len = state.client.ready.max_model_len

    def encode() -> list[list[int]]:
        return [_encode(state, p, max_len) for p in raw]

    prompts = await on_encoder_thread(encode) if any(isinstance(p, str) for p in raw) else encode()
    for ids in prompts:
        check_context(ids, params, state.client, "prompt", generated, fields)
    echoes = [e for e in await _echoes(state, fields, raw) for _ in range(params.n)]  # per choice
    if generated is not None:
        echoes = [""] * len(echoes)  # the stream being continued echoed the prompt already
    bootstrap = bootstrap_of(fields, state.client.config.disaggregation_mode, params, len(prompts), generated)
    rid = new_request_id("cmpl")
    gen = Generation(state, rid, prompts, params, fields.get("timeout"), generated, replay, bootstrap)
    gen.start()
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    with_ids = bool(fields.get("return_token_ids"))
    if fields.get("stream"):
        usage = bool((fields.get("stream_options") or {}).get("include_usage"))
        return GenerationStream(gen, lambda g: _chunks(state, g, head, usage, echoes, with_ids))
    try:
        return await unless_disconnected(request, _whole(state, gen, head, echoes, with_ids))
    finally:
        gen.close()


async def _whole(state: ServerState, gen: Generation, head: dict, echoes: list[str],
                 with_ids: bool) -> JSONResponse:
    params = gen.params
    choices = [{"index": i, "text": echoes[i], "logprobs": None, "finish_reason": None, "matched_stop": None,
                **({"token_ids": []} if with_ids else {})} for i in range(len(gen.prompts) * params.n)]
    for_logprobs: dict[int, list] = {i: [] for i in range(len(choices))}
    async for ev in gen.events():
        c = choices[ev.index]
        c["text"] += ev.text
        if with_ids:
            c["token_ids"] += ev.token_ids
        for_logprobs[ev.index] += ev.logprobs
        if ev.finish_reason is not None:
            c["finish_reason"], c["matched_stop"] = ev.finish_reason, ev.matched_stop
    if params.wants_logprobs:
        for i, c in enumerate(choices):
            c["logprobs"] = completion_logprobs(state.tokenizer, for_logprobs[i], TextOffsets(state.tokenizer))
    return JSONResponse({**head, "choices": choices, "usage": gen.usage.as_dict()})


async def _chunks(state: ServerState, gen: Generation, head: dict, include_usage: bool,
                  echoes: list[str], with_ids: bool) -> AsyncIterator[dict]:
    # a resumed stream's logprob text offsets go on from the original's (its regenerated ids included)
    resumed = (gen.generated or []) + gen.replay
    offsets = [TextOffsets(state.tokenizer, resumed if i == 0 else []) for i in range(len(echoes))]
    for i, text in enumerate(echoes):
        if text:
            yield {**head, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}],
                   **({"usage": None} if include_usage else {})}
    async for ev in gen.events():
        if not ev.token_ids and ev.finish_reason is None:
            continue  # all of it regenerated (resume.regenerate_last): its client has that text
        logprobs = None
        if gen.params.wants_logprobs:
            logprobs = completion_logprobs(state.tokenizer, ev.logprobs, offsets[ev.index])
        elif not ev.text and not with_ids and ev.finish_reason is None:
            continue  # tokens inside one character (its bytes not all there yet): nothing to send, as in chat
        choice = {"index": ev.index, "text": ev.text, "logprobs": logprobs, "finish_reason": ev.finish_reason}
        if with_ids:
            choice["token_ids"] = ev.token_ids
        if ev.finish_reason is not None:
            choice["matched_stop"] = ev.matched_stop
        out = {**head, "choices": [choice]}
        if include_usage:
            out["usage"] = None
        yield out
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage.as_dict()}
