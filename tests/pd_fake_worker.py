"""A fake `ketch serve` prefill or decode worker for the gateway's PD-mode tests: a real HTTP/1.1
server on loopback (its own process) that records every generation request it gets and how each
one ended, and behaves as the request itself tells it.

    python tests/pd_fake_worker.py --port N --role prefill|decode --name NAME

The gateway sends the same body to both workers of a pair, so the body carries what each role
should do: `"fake": {"prefill": {...}, "decode": {...}}`, each one of
    {"mode": "answer"}                          a completion saying "from NAME" (stream or not)
    {"mode": "error", "status": S, "body": B}   answers S with the JSON body B
    {"mode": "close"}                           closes the connection without an answer
    {"mode": "hold", "events": K}               (stream: headers and K events first) then waits
                                                for the peer to close the connection
    {"mode": "cut", "events": K}                stream: headers and K events, then closes
Absent: "answer". `GET /log` lists every generation request as {"path", "body", "outcome",
"request_id" (its x-request-id header)}:
outcome "pending" while it runs, then "answered", "errored", "closed_by_us" or "closed_by_peer"
(the gateway closed the connection before the fake was done: what a real server aborts on).
"""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

LOG: list[dict[str, Any]] = []


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status < 400 else 'Error'}", "connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _json_answer(status: int, obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return _head(status, {"content-type": "application/json", "content-length": str(len(body))}) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return _chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")


def _pieces(name: str) -> list[str]:
    return ["from ", name]


def _whole(path: str, name: str) -> dict[str, Any]:
    text = "".join(_pieces(name))
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    if path.endswith("/chat/completions"):
        return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": "fake", "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}]}
    return {"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake", "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}


def _stream_event(path: str, piece: str, last: bool) -> bytes:
    finish = "stop" if last else None
    if path.endswith("/chat/completions"):
        return _event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": piece},
                                    "finish_reason": finish}]})
    return _event({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake",
                   "choices": [{"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}]})


class Fake:
    def __init__(self, role: str, name: str) -> None:
        self.role, self.name = role, name

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, path, _ = request_line.split(" ", 2)
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        try:
            if method == "GET":
                writer.write(self.get(path))
            else:
                await self.generate(path, json.loads(body), reader, writer, headers.get("x-request-id"))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def get(self, path: str) -> bytes:
        if path == "/health":
            return _json_answer(200, {"status": "ok"})
        if path == "/metrics":
            text = b"ketch_num_requests_running 0\nketch_num_requests_waiting 0\n"
            return _head(200, {"content-type": "text/plain", "content-length": str(len(text))}) + text
        if path == "/v1/models":
            return _json_answer(200, {"object": "list", "data": [{"id": f"{self.role}-{self.name}", "object": "model",
                                                                  "created": 0, "owned_by": "fake"}]})
        if path == "/log":
            return _json_answer(200, LOG)
        return _json_answer(404, {"error": {"message": path, "code": "not_found"}})

    async def generate(self, path: str, body: dict[str, Any], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter, request_id: str | None) -> None:
        entry = {"path": path, "body": body, "outcome": "pending", "request_id": request_id}
        LOG.append(entry)
        how = body.get("fake", {}).get(self.role, {})
        mode, stream = how.get("mode", "answer"), body.get("stream") is True
        if mode == "error":
            writer.write(_json_answer(how["status"], how["body"]))
            entry["outcome"] = "errored"
            return
        if mode == "close":
            entry["outcome"] = "closed_by_us"
            return
        if mode in ("hold", "cut"):
            if stream:
                writer.write(_head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"}))
                for _ in range(how.get("events", 0)):
                    writer.write(_stream_event(path, "held ", last=False))
                await writer.drain()
            if mode == "cut":
                entry["outcome"] = "closed_by_us"
                return
            await reader.read()  # b"" once the gateway closes its end
            entry["outcome"] = "closed_by_peer"
            return
        if stream:
            writer.write(_head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"}))
            pieces = _pieces(self.name)
            for i, piece in enumerate(pieces):
                writer.write(_stream_event(path, piece, last=i == len(pieces) - 1))
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            writer.write(_json_answer(200, _whole(path, self.name)))
        entry["outcome"] = "answered"


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--name", required=True)
    a = p.parse_args()
    server = await asyncio.start_server(Fake(a.role, a.name).handle, "127.0.0.1", a.port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
