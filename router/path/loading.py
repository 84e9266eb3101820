"""Cold-start feedback: a streaming request that waits on a model's start hears about it every second.

A client (or a reverse proxy with a 30-60 s idle timeout) that sends ``"stream": true`` to
a stopped model would otherwise see nothing until the model is loaded. When the model is
not READY as the request arrives, the router answers the response head (200,
``text/event-stream``) after one second and then, every second until the model is READY
(the wait for the model server's answer after that is no cold start), an SSE comment line::

    : loading smollm2 2.0s of ~3.1s

SSE parsers (the OpenAI SDKs, browsers) ignore comment lines, so the stream a client reads
is unchanged. A Messages stream (Anthropic's API) gets a ``ping`` event after each comment,
the keep-alive its clients know. With ``loading_progress: reasoning`` the same text also goes out as a chat
chunk whose ``delta.reasoning_content`` holds it, for UIs that show a thinking block;
``loading_progress: off`` disables the feedback. The estimate is the model's last
measured load time. A Responses stream (``/v1/responses``) gets its head and its
``response.created`` + ``response.in_progress`` events at once (``ProxyRequest.opening``, built
by :mod:`router.api.responses`), then the same comment lines. Once the head went out, an error (a
failed start, a 4xx/5xx from the model server) arrives as the protocol's error event
(``data: {"error": ...}``, Anthropic's ``event: error``: :mod:`router.path.framing`) that ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

from starlette.types import Message, Send

from procman import State
from router.edge.body import json_or_none
from router.path.framing import OPENAI, Framing, framing_of

if TYPE_CHECKING:
    from router.path.request import ProxyRequest
    from router.state.registry import Model

__all__ = ["Feedback"]

log = logging.getLogger(__name__)

TICK_S = 1.0
STREAMING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
HEAD = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]


async def _done_within(future: asyncio.Future[None], timeout_s: float) -> bool:
    """Whether ``future`` is done within ``timeout_s`` (it is never cancelled here)."""
    await asyncio.wait({future}, timeout=timeout_s)
    return future.done()


def _wants_stream(body: bytes) -> bool:
    data = json_or_none(body)  # an /upstream body is read raw: bounded here
    return isinstance(data, dict) and data.get("stream") is True


class Feedback:
    """The ticker of one request, and what it changes once the model server answers."""

    def __init__(self, model: Model, chat: bool, send: Send, estimate_s: float | None, opening: bytes = b"",
                 framing: Framing = OPENAI) -> None:
        self.model = model
        self.framing = framing
        self.status = 200
        self.name = model.spec.name
        self.reasoning = chat and getattr(model.spec, "loading_progress", "comments") == "reasoning"
        self.send = send
        self.estimate_s = estimate_s
        self.head_sent = False
        self.rewrites = False  # the model server's answer is not the stream the head promised
        self.opening = opening  # sent with the head at once (a Responses stream's created/in_progress)
        self._buffer = b""
        self._lock = asyncio.Lock()
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = asyncio.create_task(self._tick(), name=f"loading {self.name}")

    @classmethod
    def maybe(cls, model: Model, req: ProxyRequest, send: Send, estimate_s: float | None) -> Feedback | None:
        """A running ticker when ``req`` streams from a model that is not ready; else None (the usual case)."""
        if model.backend.state is State.READY or getattr(model.spec, "loading_progress", "comments") == "off":
            return None
        path = req.path.partition("?")[0]
        if req.method != "POST" or path not in STREAMING_PATHS or not _wants_stream(req.body):
            return None
        return cls(model, path == "/v1/chat/completions", send, estimate_s, req.opening, framing_of(path) or OPENAI)

    def text(self) -> str:
        elapsed = time.monotonic() - self._t0
        estimate = f" of ~{self.estimate_s:.1f}s" if self.estimate_s else ""
        return f"loading {self.name} {elapsed:.1f}s{estimate}"

    async def _tick(self) -> None:
        if self.opening:
            async with self._lock:
                await self.send({"type": "http.response.start", "status": 200, "headers": HEAD})
                self.head_sent = True
                await self.send({"type": "http.response.body", "body": self.opening, "more_body": True})
        ready = self.model.backend.ready()
        try:
            while not await _done_within(ready, TICK_S):
                await self._send_tick()
        finally:
            ready.cancel()  # loaded: the request is on its way upstream; waiting for its answer is not loading

    async def _send_tick(self) -> None:
        async with self._lock:
            if not self.head_sent:
                await self.send({"type": "http.response.start", "status": 200, "headers": HEAD})
                self.head_sent = True
            await self.send({"type": "http.response.body", "body": self._event(self.text()), "more_body": True})

    def _event(self, text: str) -> bytes:
        event = self.framing.tick(text)
        if self.reasoning:
            chunk = {"id": "loading", "object": "chat.completion.chunk", "created": int(time.time()),
                     "model": self.name, "choices": [{"index": 0, "delta": {"reasoning_content": text + "\n"},
                                                      "logprobs": None, "finish_reason": None}]}
            event += b"data: " + json.dumps(chunk).encode() + b"\n\n"
        return event

    async def stop(self) -> None:
        """Stop ticking; returns once no tick is being sent."""
        task, self._task = self._task, None
        if task is None:
            return
        async with self._lock:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def upstream_start(self, message: Message, sse: bool) -> bool:
        """The model server's response head; True when the client already has a head (this one is dropped)."""
        await self.stop()
        if not self.head_sent:
            return False
        if message["status"] != 200 or not sse:
            self.rewrites, self.status = True, message["status"]
            log.info("%s answered %s after the loading feedback; relayed as an error event", self.name,
                     message["status"])
        return True

    async def relay_body(self, message: Message) -> None:
        """The model server's body when it is not an SSE stream: gathered, then sent as one error event."""
        self._buffer += message.get("body", b"")
        if message.get("more_body", False):
            return
        try:
            error = json.loads(self._buffer)["error"]
            text = str(error["message"])
        except (ValueError, KeyError, TypeError):
            error, text = None, self._buffer[:500].decode("utf-8", "replace")
        if self.framing is OPENAI and error is not None:  # the model server's own error object, as it is
            body = b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"
        else:
            body = self.framing.error(text, "backend_error", self.status)
        await self.send({"type": "http.response.body", "body": body, "more_body": True})
        await self.send({"type": "http.response.body", "body": b""})
