"""The whole router in-process, over fakes: procman under a fake spawner/prober/clock and a fake
:class:`router.edge.upstream.Upstream`. Requests go straight into the ASGI app; no socket, no process.

    async with fake_router(tmp_path, {"echo": fake_model()}) as router:
        router.edge.upstream.handler = my_handler           # what the "backend" answers
        reply = await router.post("/v1/chat/completions", chat("echo"))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from procman import Address
from router.app import build_app
from router.config import parse_config
from router.edge.heartbeat import Watch
from router.edge.httpclient import UpstreamHung, UpstreamTimeout
from router.service import RouterService
from tests.procman_fakes import FakeProcess, Harness

Item = bytes | asyncio.Event | BaseException


class FakeReply:
    """A backend's answer: a whole ``body``, or ``chunks`` streamed one by one (an Event waits, an
    exception is raised where it stands). ``closed`` tells whether the router let go of it."""

    def __init__(
        self,
        status: int = 200,
        body: bytes | None = None,
        *,
        chunks: Sequence[Item] = (),
        headers: Sequence[tuple[bytes, bytes]] = (),
        content_type: bytes = b"application/json",
    ) -> None:
        self.status = status
        self.raw_headers = [(b"content-type", content_type), *headers]
        self._items: list[Item] = [body] if body is not None else list(chunks)
        self.complete = body is not None
        if body is not None:
            self.raw_headers.append((b"content-length", str(len(body)).encode()))
        self.closed = False

    @classmethod
    def json(cls, status: int, data: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> FakeReply:
        return cls(status, json.dumps(data).encode(), headers=headers)

    @property
    def content_length(self) -> int | None:
        value = self.header(b"content-length")
        return int(value) if value is not None else None

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.raw_headers if k == name), None)

    async def iter_chunks(self, idle_timeout_s: float | None = None) -> AsyncIterator[bytes]:
        for item in self._items:
            if isinstance(item, asyncio.Event):
                try:
                    await asyncio.wait_for(item.wait(), idle_timeout_s)
                except TimeoutError:
                    raise UpstreamTimeout(f"backend sent nothing for {idle_timeout_s:g}s") from None
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def read(self, idle_timeout_s: float | None = None) -> bytes:
        return b"".join([chunk async for chunk in self.iter_chunks(idle_timeout_s)])

    def close(self) -> None:
        self.closed = True


@dataclass
class Call:
    """One request as the fake backend saw it."""

    address: Address
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    proc: FakeProcess | None
    watch: Watch | None = None  # the heartbeats the router asked for (router/edge/heartbeat.py)

    def beat(self, progress: int | None = None) -> None:
        """Send one heartbeat (a 102 with ``progress``), as a model server does while it answers."""
        if self.watch is not None:
            self.watch.beat(time.monotonic(), progress)

    @property
    def text(self) -> str:
        """The last user message of a chat body ('' for anything else)."""
        try:
            return str(json.loads(self.body)["messages"][-1]["content"])
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):  # hostile bodies reach it via /upstream
            return ""


Handler = Callable[[Call], Awaitable[FakeReply]]


async def echo(call: Call) -> FakeReply:
    """The default backend: answers a chat with its last message, 200."""
    return FakeReply.json(200, {"choices": [{"message": {"content": call.text}}], "pid": call.proc and call.proc.pid})


class FakeUpstream:
    """An :class:`router.edge.upstream.Upstream` that asks ``handler`` instead of opening a connection."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.handler: Handler = echo
        self.calls: list[Call] = []
        self.replies: list[FakeReply] = []

    async def request(
        self,
        address: Address,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        head_timeout_s: float | None,
        watch: Watch | None = None,
    ) -> FakeReply:
        proc = next((p for p in self.harness.spawner.procs if p.serves(address)), None)
        call = Call(address, method, path, headers, body, proc, watch)
        self.calls.append(call)
        try:
            reply = await asyncio.wait_for(_judged(self.handler(call), watch), head_timeout_s)
        except TimeoutError:  # as the real client says it: a late head is the 504 path
            raise UpstreamTimeout(f"no response within {head_timeout_s:g}s") from None
        self.replies.append(reply)
        return reply

    async def close(self) -> None:
        pass


async def _judged(answer: Awaitable[FakeReply], watch: Watch | None) -> FakeReply:
    """The handler's reply, or UpstreamHung as the real client raises it when the heartbeats stop or stand still."""
    task = asyncio.ensure_future(answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=watch.check_s() if watch is not None else None)
            if done:
                return task.result()
            verdict = watch.expired(time.monotonic()) if watch is not None else None
            if verdict is not None:
                raise UpstreamHung(*verdict)
    finally:
        task.cancel()


@dataclass
class Exchange:
    """What the client got: status, headers, and every body message as it was sent."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeRouter:
    app: Any
    service: RouterService
    harness: Harness
    upstream: FakeUpstream

    def backend(self, name: str) -> Any:
        return self.service.registry.models[name].backend

    def client(self, api_key: str | None = None) -> httpx.AsyncClient:
        """An httpx client straight into the app (whole bodies only: :meth:`post` sees a stream's chunks)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://testserver",
                                 headers=headers)

    async def post(
        self, path: str, data: Any = None, *, content: bytes | None = None, disconnect: asyncio.Event | None = None
    ) -> Exchange:
        """POST through the ASGI app; ``disconnect`` set = the client hangs up."""
        body = content if content is not None else json.dumps(data).encode()
        return await self.request("POST", path, body, disconnect=disconnect)

    async def request(
        self, method: str, path: str, body: bytes = b"", *, disconnect: asyncio.Event | None = None,
        into: Exchange | None = None,
    ) -> Exchange:
        """One exchange through the ASGI app, its body messages kept as sent (``into``: read them meanwhile)."""
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path.partition("?")[0], "raw_path": path.encode(), "query_string": path.partition("?")[2].encode(),
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 40000), "server": ("testserver", 80),
        }  # fmt: skip
        sent = False
        gone = disconnect or asyncio.Event()
        result = into or Exchange()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                result.status = message["status"]
                result.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
            elif message["type"] == "http.response.body" and message.get("body"):
                result.chunks.append(message["body"])

        await self.app(scope, receive, send)
        return result


def chat(model: str, text: str = "hello there world", **extra: object) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


@contextlib.asynccontextmanager
async def fake_router(
    tmp_path: Path, models: dict[str, Any], groups: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None, prober: Any = None,
) -> AsyncIterator[FakeRouter]:
    """A router over ``models`` (raw config mappings; ``router``: its own settings), its lifespan running,
    every backend a fake (``prober``: procman's, instead of the fake one)."""
    harness = Harness(tmp_path / "runtime", prober=prober)
    config = parse_config({"router": {"state_dir": str(tmp_path / "state"), **(router or {})}, "models": models,
                           "groups": groups or {}}, tmp_path)
    upstream = FakeUpstream(harness)
    service = RouterService(config, manager=harness.manager, upstream=upstream)
    app = build_app(config, service)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    life = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get,
                                     outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield FakeRouter(app, service, harness, upstream)
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(outbox.get(), 30)
        await asyncio.wait_for(life, 30)
        assert harness.spawner.alive() == [], "a fake model process outlived the router"
