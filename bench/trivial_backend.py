"""A trivial, fast OpenAI-compatible backend: the baseline every proxy is measured against.

A bare ASGI callable (no framework) on uvicorn with httptools and uvloop, access log off:

- ``POST /v1/chat/completions`` -> a fixed small chat completion; with ``"stream": true``
  an SSE stream of ``--chunks`` deltas, ``--chunk-gap-ms`` apart, then ``data: [DONE]``;
- ``GET /health`` -> 200, ``GET /v1/models`` -> the one model.

``python -m bench.trivial_backend --port N`` (or ``--uds PATH``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["build_app", "main"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

MODEL = "trivial"
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _completion() -> bytes:
    body = {
        "id": "chatcmpl-trivial",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _chunk(delta: dict[str, str], finish: str | None) -> bytes:
    body = {
        "id": "chatcmpl-trivial",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


COMPLETION = _completion()
HEALTH = b'{"status":"ok"}'
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]}).encode()
NOT_FOUND = b'{"error":{"message":"not found","type":"invalid_request_error","code":"not_found"}}'


async def _read_body(receive: Receive) -> bytes:
    parts = []
    more = True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


async def _stream(send: Send, chunks: int, gap_s: float) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    await send({"type": "http.response.body", "body": _chunk({"role": "assistant"}, None), "more_body": True})
    for index in range(chunks):
        await asyncio.sleep(gap_s)
        await send({"type": "http.response.body", "body": _chunk({"content": f"w{index} "}, None), "more_body": True})
    await send({"type": "http.response.body", "body": _chunk({}, "stop") + b"data: [DONE]\n\n"})


def _wants_stream(body: bytes) -> bool:
    if b'"stream"' not in body:
        return False
    try:
        return bool(json.loads(body).get("stream"))
    except (ValueError, AttributeError):
        return False


def build_app(chunks: int = 16, chunk_gap_ms: float = 2.0) -> App:
    """The ASGI app; ``chunks``/``chunk_gap_ms`` shape the streamed answer."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/chat/completions" and scope["method"] == "POST":
            body = await _read_body(receive)
            if _wants_stream(body):
                await _stream(send, chunks, chunk_gap_ms / 1000)
            else:
                await _respond(send, 200, COMPLETION)
        elif path == "/health":
            await _respond(send, 200, HEALTH)
        elif path == "/v1/models":
            await _respond(send, 200, MODELS)
        else:
            await _respond(send, 404, NOT_FOUND)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m bench.trivial_backend", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int)
    where.add_argument("--uds")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--chunks", type=int, default=16, help="deltas in a streamed answer")
    parser.add_argument("--chunk-gap-ms", type=float, default=2.0, help="pause between streamed deltas")
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(args.chunks, args.chunk_gap_ms),
        host=args.host,
        port=args.port or 0,
        uds=args.uds,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="off",
    )


if __name__ == "__main__":
    main()
