"""Helpers for the PD tests over real servers: an answer, stream or not, folded into one shape."""
from __future__ import annotations

import json

from server_util import connect, post


def call(base: str, path: str, body: dict) -> tuple[int, dict]:
    """One answer as (status, JSON): a stream is folded into the whole answer's shape."""
    if not body.get("stream"):
        return post(base, path, body)
    conn = connect(base)
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, json.loads(resp.read())
        text, reason, usage, error = "", None, None, None
        for line in resp.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk
            for c in chunk.get("choices", []):
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                reason = c.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
        if error is not None:
            return 500, error
        return 200, {"text": text, "finish_reason": reason, "usage": usage}
    finally:
        conn.close()


def answer(status: int, body: dict) -> tuple:
    assert status == 200, body
    if "text" in body:
        text, reason = body["text"], body["finish_reason"]
    else:
        c = body["choices"][0]
        text, reason = c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"]
    u = body["usage"]
    return text, reason, u["prompt_tokens"], u["completion_tokens"]
