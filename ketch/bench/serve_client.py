"""One streamed OpenAI request, timed: TTFT, inter-chunk gaps, E2E, and the server's token counts.

The SSE `data:` payloads reach `_Recorder.on_data` from the connection's read callback
(serve_http.py), stamped with the time of the socket read that brought them, so the timing sees
each chunk when it arrives and a token costs one msgspec decode into a struct that names only the
fields read here. Nothing raises out of `send_request`: every failure becomes a RequestResult with
`success=False` and an error message, so one bad request never ends a benchmark run.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from ketch.bench.datasets import SampleRequest
from ketch.bench.serve_http import HTTPClient
from ketch.bench.serve_metrics import RequestResult

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
UNCOUNTED = -1  # output_len (multiturn: prompt_len too) of a success whose server reported no usage, until counted
# Between an answer and the next user turn of a conversation sent to /v1/completions. The answer
# follows its user turn with nothing between (as it was generated), so each round's prompt starts
# with the previous round's prompt and answer: the tokens the server has just cached.
TURN_SEPARATOR = "\n\n"


def completion_prompt(req: SampleRequest) -> str:
    """The prompt text: a conversation's turns as one text (user turn, its answer, separator, ...)."""
    h = req.history
    return "".join(h[i] + h[i + 1] + TURN_SEPARATOR for i in range(0, len(h) - 1, 2)) + req.prompt


def chat_messages(req: SampleRequest) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": text} for i, text in enumerate((*req.history, req.prompt))]


@dataclass(frozen=True)
class RequestConfig:
    base_url: str
    backend: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: tuple[tuple[str, Any], ...] = ()
    timeout_s: float = 3600.0  # one request, from sending to the end of its response

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {sorted(BACKENDS)}, got {self.backend!r}")

    @property
    def path(self) -> str:
        return BACKENDS[self.backend]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.backend == "openai":
            body["prompt"] = completion_prompt(req)
        else:
            body["messages"] = chat_messages(req)
        body.update(dict(self.extra_body))
        return body


def make_client(base_url: str) -> HTTPClient:
    return HTTPClient(base_url, connect_timeout_s=30.0)


# The chunk fields the benchmark reads; msgspec skips the others without building them. gc=False:
# a struct per token would otherwise feed the cyclic GC's young generation (no cycles are possible).
class _Delta(msgspec.Struct, gc=False):
    content: str | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str | None = None  # /v1/completions
    delta: _Delta | None = None  # /v1/chat/completions


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class _Recorder:
    """Consumes one response's `data:` payloads as they arrive; returns True to hear no more."""

    __slots__ = ("chat", "first", "last", "itl", "text", "usage", "error", "end")

    def __init__(self, chat: bool, start: float) -> None:
        self.chat = chat
        self.first: float | None = None
        self.last = start
        self.itl: list[float] = []
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error = ""
        self.end: float | None = None  # when [DONE] arrived

    def on_data(self, payload: bytes, now: float) -> bool:
        if payload == b"[DONE]":
            self.end = now
            return True
        try:
            chunk = _decode_chunk(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.error = f"bad chunk ({type(e).__name__}: {e}): {payload[:120]!r}"
            return True
        if chunk.error is not None:  # an error after the headers travels inside the stream
            err = chunk.error
            self.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            return True
        if chunk.usage:
            self.usage = chunk.usage
        if chunk.choices:
            c = chunk.choices[0]
            piece = (c.delta.content if c.delta is not None else None) if self.chat else c.text
            if piece:
                if self.first is None:
                    self.first = now
                else:
                    self.itl.append(now - self.last)
                self.last = now
                self.text.append(piece)
        return False


async def send_request(client: HTTPClient, cfg: RequestConfig, req: SampleRequest) -> RequestResult:
    """Stream one request. Token counts come from the server's usage when it reports them; without
    it the output length is UNCOUNTED and `count_outputs` tokenizes the text after the run (not
    inside the timed window, where it would slow the client down)."""
    res = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    rec = _Recorder(cfg.backend == "openai-chat", start)
    body = msgspec.json.encode(cfg.payload(req))
    try:
        async with asyncio.timeout(cfg.timeout_s):
            status, error_body = await client.request("POST", cfg.path, body, cfg.headers(), rec.on_data)
    except TimeoutError:
        if rec.end is None:  # past [DONE] only the end of the HTTP body was missing: the answer is whole
            res.error = f"TimeoutError: no complete answer within {cfg.timeout_s:g} s"
            return res
        status = 200
    except Exception as e:  # network errors, bad framing: a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    if status != 200:
        res.error = f"HTTP {status}: {error_body.decode('utf-8', 'replace').strip()[:200]}"
        return res
    if rec.error:
        res.error = rec.error
        return res
    end = rec.end if rec.end is not None else time.perf_counter()
    res.latency = end - start
    # no content at all (e.g. an immediate stop): the first token is the end of the response
    res.ttft = (rec.first if rec.first is not None else end) - start
    res.itl = rec.itl
    res.generated_text = "".join(rec.text)
    usage = rec.usage
    if usage and isinstance(usage.get("prompt_tokens"), int):
        res.prompt_len = usage["prompt_tokens"]
    if usage and isinstance(usage.get("completion_tokens"), int):
        res.output_len = usage["completion_tokens"]
    else:
        res.output_len = UNCOUNTED
    details = usage.get("prompt_tokens_details") if usage else None
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        res.cached_tokens = details["cached_tokens"]
    timing = usage.get("pd_timing") if usage else None  # a PD decode server's TTFT split
    if isinstance(timing, dict):
        res.pd_timing = timing
    res.success = True
    return res


def count_outputs(results: list[RequestResult], count_tokens: Callable[[str], int]) -> None:
    """Fill in the output length of every success the server did not count, from its text."""
    for r in results:
        if r.success and r.output_len == UNCOUNTED:
            r.output_len = count_tokens(r.generated_text)


async def fetch_model(client: HTTPClient, api_key: str | None) -> str:
    """The first model id that GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, body = await client.request("GET", "/v1/models", headers=headers)
        if status != 200:
            raise ValueError(f"HTTP {status}: {body.decode('utf-8', 'replace').strip()[:200]}")
        return msgspec.json.decode(body)["data"][0]["id"]
    except Exception as e:
        url = f"{client.base_url}/v1/models"
        raise ValueError(f"model: not given and GET {url} did not name one ({type(e).__name__}: {e})") from None


async def flush_cache(client: HTTPClient, api_key: str | None) -> str:
    """POST /flush_cache (ketch's and SGLang's): the server empties its prefix cache. Returns what
    it said (ketch answers JSON with the pages it freed, SGLang plain text); raises ValueError when
    the server refuses or has no such endpoint."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    status, body = await client.request("POST", "/flush_cache", b"", headers)
    text = body.decode("utf-8", "replace").strip()
    if status != 200:
        raise ValueError(f"flush_cache: POST {client.base_url}/flush_cache answered HTTP {status}: {text[:200]}")
    try:
        answer = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return text[:200]
    if isinstance(answer, dict) and "freed_pages" in answer:
        return f"{answer['freed_pages']} device pages freed, {answer.get('freed_host_pages', 0)} host pages"
    return text[:200]
