"""A stand-in for llama-cpp-python's server (stdlib only): a concurrent request cuts the stream in progress.

    python cutstream.py (--port N | --uds PATH) [--chunks K] [--cut abort|clean] [--no-interrupt] [--prefix /v3]

llama-cpp-python's server (``python -m llama_cpp.server``, ``--interrupt_requests true`` by
default) ends a stream in progress as soon as another request wants the model, and
``GET /v1/models`` (the only readiness path it has) is such a request: every health probe
cuts the stream. This stand-in does the same, and its process stays alive. Its events end
with CRLF line breaks (``data: ...\r\n\r\n``), as sse-starlette, that server's SSE layer, writes them.

- ``POST /v1/chat/completions`` and ``/v1/completions`` with ``"stream": true``: the first
  chunk, then K token chunks, then nothing more until ``POST /release`` (the stream then
  finishes with ``finish_reason`` and ``data: [DONE]``) or until a cut. A stream cannot end
  by itself. Without ``stream``: a short JSON answer.
- ``GET /v1/models``, and any chat or completion request, takes the model: while a stream
  is in progress it cuts that stream; with ``--no-interrupt`` (``--interrupt_requests
  false``) ``/v1/models`` waits instead until no stream is in progress. ``--cut abort`` (the
  default, what llama-cpp-python 0.3 does) sends ``data: [DONE]`` and closes the connection
  mid-body (no final chunk, no ``finish_reason``); ``--cut clean`` ends the chunked body
  properly, but without ``[DONE]``.
- ``GET /health``: 200, takes nothing (llama.cpp's own server has this path).
- ``GET /stats``: ``{"pid", "models_requests", "cuts", "streams", "holding"}``, takes nothing;
  ``holding``: streams sent their K chunks and wait.
- ``--prefix /v3``: the ``/v1`` routes answer only under that prefix (as OVMS serves them
  under ``/v3``); ``/health`` and ``/stats`` stay where they are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

STATS: dict[str, int] = {"pid": os.getpid(), "models_requests": 0, "cuts": 0, "streams": 0, "holding": 0}
ACTIVE: set[asyncio.Future[str]] = set()  # each stream in progress waits on its future: "release" or "cut"
ARGS = argparse.Namespace()


def take_model() -> None:
    """A request wants the model: cut every stream in progress (llama-cpp-python's interrupt_requests)."""
    if ARGS.interrupt:
        for waiter in list(ACTIVE):
            if not waiter.done():
                waiter.set_result("cut")


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode("latin-1").split(" ", 2)
    length = 0
    while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = header.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return method, path, await reader.readexactly(length) if length else b""


def answer(writer: asyncio.StreamWriter, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    writer.write(head.encode() + data)


def event(kind: str, piece: dict[str, Any]) -> bytes:
    chunk = {"id": "cmpl-standin", "object": kind, "created": int(time.time()), "model": "standin", "choices": [piece]}
    data = f"data: {json.dumps(chunk)}\r\n\r\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def stream(writer: asyncio.StreamWriter, chat: bool) -> bool:
    """One held stream; False when it was cut with the connection closed."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def piece(text: str | None, finish: str | None = None) -> dict[str, Any]:
        if chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
            return {"index": 0, "delta": delta, "finish_reason": finish}
        return {"index": 0, "text": text or "", "finish_reason": finish}

    waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    ACTIVE.add(waiter)
    STATS["streams"] += 1
    try:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(event(kind, piece(None)))
        for i in range(ARGS.chunks):
            writer.write(event(kind, piece(f"t{i} ")))
        await writer.drain()
        STATS["holding"] += 1
        how = await waiter
        STATS["holding"] -= 1
    finally:
        ACTIVE.discard(waiter)
    if how == "cut":
        STATS["cuts"] += 1
        print(f"stream cut by a concurrent request ({ARGS.cut})", flush=True)
        if ARGS.cut == "abort":
            writer.write(b"10\r\ndata: [DONE]\r\n\r\n\r\n")
            await writer.drain()
            writer.transport.abort()
            return False
        writer.write(b"0\r\n\r\n")
        return True
    writer.write(event(kind, piece("", "stop")) + b"10\r\ndata: [DONE]\r\n\r\n\r\n0\r\n\r\n")
    return True


async def handle(method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
    if ARGS.prefix and path.startswith("/v1/"):
        path = "/unprefixed"  # not served without the prefix
    elif ARGS.prefix and path.startswith(ARGS.prefix + "/v1/"):
        path = path[len(ARGS.prefix):]
    if path == "/health":
        answer(writer, 200, {"status": "ok"})
    elif path == "/stats":
        answer(writer, 200, STATS)
    elif path == "/release" and method == "POST":
        for waiter in list(ACTIVE):
            if not waiter.done():
                waiter.set_result("release")
        answer(writer, 200, {"released": True})
    elif path == "/v1/models":
        STATS["models_requests"] += 1
        take_model()
        while not ARGS.interrupt and ACTIVE:  # the model is busy: wait for it, as llama-cpp-python's lock does
            await asyncio.wait(set(ACTIVE))
        answer(writer, 200, {"object": "list", "data": [{"id": "standin", "object": "model"}]})
    elif path in ("/v1/chat/completions", "/v1/completions") and method == "POST":
        take_model()
        request = json.loads(body or b"{}")
        if request.get("stream"):
            return await stream(writer, path.endswith("chat/completions"))
        answer(writer, 200, {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
    else:
        answer(writer, 404, {"error": {"message": f"no route {method} {path}"}})
    return True


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while (request := await read_request(reader)) is not None:
            if not await handle(*request, writer):
                return
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def main() -> None:
    parser = argparse.ArgumentParser()
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int)
    where.add_argument("--uds")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--cut", choices=("abort", "clean"), default="abort")
    parser.add_argument("--no-interrupt", dest="interrupt", action="store_false")
    parser.add_argument("--prefix", default="")
    parser.parse_args(namespace=ARGS)
    if ARGS.uds:
        server = await asyncio.start_unix_server(serve, ARGS.uds)
    else:
        server = await asyncio.start_server(serve, "127.0.0.1", ARGS.port)
    print(f"cutstream pid={os.getpid()} serving", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
