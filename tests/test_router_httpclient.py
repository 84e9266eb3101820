"""router/edge/httpclient.py against an in-process asyncio server that answers exactly what each test
scripts: sized, chunked and close-delimited bodies, HEAD, a stale keep-alive socket, a malformed
head, the never-resend rule, timeouts and pause/resume at the high-water mark."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.edge import httpclient
from router.edge.httpclient import ConnectionPool, UpstreamError, UpstreamTimeout

pytestmark = pytest.mark.timeout(20)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@dataclass
class Server:
    """What the backend saw: connections opened and requests read (method, path, body)."""

    connections: int = 0
    requests: list[tuple[str, str, bytes]] = field(default_factory=list)

    async def read_request(self, reader: asyncio.StreamReader) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = next((int(v) for k, _, v in (x.partition(": ") for x in lines[1:]) if k == "content-length"), 0)
        self.requests.append((method, path, await reader.readexactly(length) if length else b""))
        return True


@contextlib.asynccontextmanager
async def backend(script: Script, tmp_path: Path | None = None) -> AsyncIterator[tuple[ConnectionPool, Server]]:
    """A backend running ``script`` per connection; yields a pool pointed at it (UDS when tmp_path)."""
    seen = Server()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        try:
            await script(reader, writer, seen)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    if tmp_path is not None:
        path = str(tmp_path / "b.sock")
        server = await asyncio.start_unix_server(on_connect, path)
        pool = ConnectionPool(uds=path, connect_timeout_s=2)
    else:
        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = ConnectionPool(url=f"http://127.0.0.1:{port}", connect_timeout_s=2)
    try:
        yield pool, seen
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


def keep_alive(body: bytes = b"hello", status: str = "200 OK", extra: bytes = b"") -> Script:
    """Answer every request on the connection with a sized body."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        while await seen.read_request(reader):
            writer.write(b"HTTP/1.1 " + status.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                         + b"\r\n" + extra + b"\r\n" + body)
            await writer.drain()

    return script


async def get(pool: ConnectionPool, method: str = "GET", body: bytes = b"", **kw: float) -> tuple[int, bytes]:
    resp = await pool.request(method, "/x", [("accept", "*/*")], body, head_timeout_s=kw.get("head_timeout_s", 5))
    try:
        return resp.status, await resp.read(kw.get("idle_timeout_s", 5))
    finally:
        resp.close()


async def test_sized_body_and_the_connection_is_kept_alive(tmp_path: Path) -> None:
    async with backend(keep_alive(b"hello")) as (pool, seen):
        assert await get(pool, "POST", b'{"a": 1}') == (200, b"hello")
        assert await get(pool) == (200, b"hello")
        assert seen.connections == 1 and seen.requests == [("POST", "/x", b'{"a": 1}'), ("GET", "/x", b"")]


async def test_one_connection_carries_chunked_and_sized_answers_in_turn() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        while await seen.read_request(reader):
            if len(seen.requests) % 2:
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\n\r\nsized")
            await writer.drain()

    async with backend(script) as (pool, seen):
        answers = [await get(pool) for _ in range(4)]
        assert answers == [(200, b"abcde"), (201, b"sized")] * 2
        assert seen.connections == 1


async def test_header_names_are_lower_case_and_a_repeated_one_reads_as_its_first_value() -> None:
    async with backend(keep_alive(b"ok", extra=b"X-Seen: 1\r\nx-seen: 2\r\nContent-Type: text/plain\r\n")) as (pool, _):
        resp = await pool.request("GET", "/x", [], b"", head_timeout_s=5)
        try:
            assert resp.header(b"x-seen") == b"1" and resp.header(b"content-type") == b"text/plain"
            assert resp.header(b"x-absent") is None and resp.content_length == 2
            assert (b"x-seen", b"2") in resp.raw_headers
        finally:
            resp.close()


async def test_over_a_unix_socket(tmp_path: Path) -> None:
    async with backend(keep_alive(b"uds"), tmp_path) as (pool, seen):
        assert await get(pool) == (200, b"uds") and seen.connections == 1


async def test_chunked_body_arrives_chunk_by_chunk() -> None:
    sent = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        writer.write(b"5\r\nfirst\r\n")
        await writer.drain()
        await sent.wait()  # the second chunk only after the client has the first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with backend(chunked) as (pool, _):
        resp = await pool.request("GET", "/s", [], b"", head_timeout_s=5)
        chunks = resp.iter_chunks(5)
        assert await chunks.__anext__() == b"first"
        sent.set()
        assert [c async for c in chunks] == [b"second"] and resp.complete
        resp.close()


async def test_close_delimited_body_ends_with_the_connection() -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of ")
        await writer.drain()
        writer.write(b"it")
        await writer.drain()

    async with backend(close_delimited) as (pool, seen):
        assert await get(pool) == (200, b"all of it")
        assert await get(pool) == (200, b"all of it")
        assert seen.connections == 2  # never reused


async def test_head_ends_at_the_response_head_whatever_content_length_says() -> None:
    async def head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        while await seen.read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")  # no body follows a HEAD
            await writer.drain()

    async with backend(head) as (pool, seen):
        resp = await pool.request("HEAD", "/x", [], b"", head_timeout_s=5)
        assert resp.status == 200 and resp.complete and await resp.read(1) == b""
        resp.close()
        assert await get(pool, "HEAD") == (200, b"")
        assert seen.connections == 2  # a HEAD's connection is not reused


async def test_stale_keep_alive_socket_is_replaced_by_a_fresh_one() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()  # then the server closes its end, as an idle timeout would

    async with backend(one_then_close) as (pool, seen):
        assert await get(pool) == (200, b"ok")
        await asyncio.sleep(0.05)  # let the close reach the pooled connection... or not: both must work
        assert await get(pool) == (200, b"ok")
        assert seen.connections == 2 and len(seen.requests) == 2


async def test_malformed_head_is_an_upstream_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"SPDY/9 banana\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with backend(garbage) as (pool, _):
        with pytest.raises(UpstreamError, match="malformed"):
            await get(pool)


async def test_a_request_the_backend_answered_in_part_is_never_resent() -> None:
    async def second_breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await seen.read_request(reader)  # the second request, on the kept-alive connection
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-")  # half a head, then the connection dies
        await writer.drain()

    async with backend(second_breaks) as (pool, seen):
        assert await get(pool) == (200, b"ok")
        with pytest.raises(UpstreamError):
            await get(pool, "POST", b"generate")
        assert [r[0] for r in seen.requests] == ["GET", "POST"] and seen.connections == 1  # sent once, never twice


async def test_no_head_in_time_is_an_upstream_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        await reader.read()

    async with backend(silent) as (pool, _):
        with pytest.raises(UpstreamTimeout, match="no response within 0.05s"):
            await get(pool, head_timeout_s=0.05)


async def test_silence_between_chunks_is_an_upstream_timeout() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\none\r\n")
        await writer.drain()
        await reader.read()

    async with backend(stalls) as (pool, _):
        resp = await pool.request("GET", "/s", [], b"", head_timeout_s=5)
        chunks = resp.iter_chunks(0.05)
        assert await chunks.__anext__() == b"one"
        with pytest.raises(UpstreamTimeout, match="sent nothing for 0.05s"):
            await chunks.__anext__()
        resp.close()


async def test_nobody_listening_is_an_upstream_error(tmp_path: Path) -> None:
    pool = ConnectionPool(uds=str(tmp_path / "nobody.sock"), connect_timeout_s=1)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await get(pool)


async def test_a_slow_reader_pauses_the_backend_at_the_high_water_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(httpclient, "HIGH_WATER", 64 * 1024)
    body = bytes(range(256)) * 4096  # 1 MiB

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Server) -> None:
        await seen.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await reader.read()

    async with backend(big) as (pool, _):
        resp = await pool.request("GET", "/big", [], b"", head_timeout_s=5)
        transport = resp._conn.transport
        assert transport is not None
        while resp._buffered <= httpclient.HIGH_WATER:  # nobody reads: the buffer fills up to the mark...
            await asyncio.sleep(0.001)
        assert not transport.is_reading()  # ...and reading from the backend pauses there
        got = await resp.read(5)
        assert got == body and resp.complete and transport.is_reading()  # drained: reading resumed
        resp.close()
