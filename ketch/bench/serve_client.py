"""One streamed OpenAI request, timed: TTFT, inter-chunk gaps, E2E, and the server's token counts.

SSE is parsed here (`data: {...}` lines, `data: [DONE]` at the end) so the timing sees each chunk
when it arrives. Nothing raises out of `send_request`: every failure becomes a RequestResult with
`success=False` and an error message, so one bad request never ends a benchmark run.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

try:  # openai's HTTP client; published as httpx2 in newer environments
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the environment
    import httpx  # type: ignore[no-redef]

from ketch.bench.datasets import SampleRequest
from ketch.bench.serve_metrics import RequestResult

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class RequestConfig:
    base_url: str
    backend: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {sorted(BACKENDS)}, got {self.backend!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + BACKENDS[self.backend]

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
            body["prompt"] = req.prompt
        else:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        body.update(dict(self.extra_body))
        return body


def make_client(max_connections: int | None, timeout_s: float) -> httpx.AsyncClient:
    # httpx caps a pool at 100 connections by default, which would cap the benchmark's concurrency
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


def _content(chunk: dict, backend: str) -> str:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    if backend == "openai":
        return choices[0].get("text") or ""
    return (choices[0].get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, cfg: RequestConfig, req: SampleRequest,
                       count_tokens: Callable[[str], int]) -> RequestResult:
    """Stream one request. Token counts come from the server's usage when it reports them; the
    output is tokenized with `count_tokens` otherwise."""
    res = RequestResult(prompt_len=req.prompt_len)
    usage: dict | None = None
    text: list[str] = []
    start = last = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", cfg.url, json=cfg.payload(req), headers=cfg.headers()) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body.strip()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the headers travels inside the stream
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                piece = _content(chunk, cfg.backend)
                if piece:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        res.itl.append(now - last)
                    last = now
                    text.append(piece)
    except Exception as e:  # network errors, bad JSON, timeouts: a failed request, not a crash
        res.error = f"{type(e).__name__}: {e}"
        return res
    end = time.perf_counter()
    res.latency = end - start
    # no content at all (e.g. an immediate stop): the first token is the end of the response
    res.ttft = (first if first is not None else end) - start
    res.generated_text = "".join(text)
    if usage and isinstance(usage.get("prompt_tokens"), int):
        res.prompt_len = usage["prompt_tokens"]
    if usage and isinstance(usage.get("completion_tokens"), int):
        res.output_len = usage["completion_tokens"]
    else:
        res.output_len = count_tokens(res.generated_text)
    res.success = True
    return res


async def fetch_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model id that GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:
        raise ValueError(f"model: not given and GET {url} did not name one ({type(e).__name__}: {e})") from None
