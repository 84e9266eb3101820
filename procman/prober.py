"""Asking a backend whether it is ready: one ``GET <health_path>`` (or ``HEAD``), its status and body.

The real prober speaks just enough HTTP/1.1 over an asyncio stream (Unix socket or TCP,
TLS for an ``https`` remote) to read the status line and a bounded body; it needs no
client session to keep or close, and a hung server costs one bounded timeout.

The probes procman sends (readiness while STARTING, the health watch while READY) are the
only ones: the last answer of each process is kept as a :class:`Health` (its parsed JSON
body and when it came) that everybody else reads (``Backend.last_health``) instead of
asking the backend again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from procman.address import Address

__all__ = ["Answer", "Health", "HttpProber", "Prober", "health_of"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 65536


#: An answer to a probe: the HTTP status and the body (bounded); None when nothing answered in time.
Answer = tuple[int, bytes]


@dataclass(frozen=True, slots=True)
class Health:
    """The last answer of a backend to a health probe: ``status``, ``body`` (its JSON object; None when the
    body is not one) and ``at`` (the runtime's clock when it came)."""

    status: int
    body: Mapping[str, Any] | None
    at: float

    @property
    def ok(self) -> bool:
        return self.status == 200


def health_of(answer: Answer, at: float) -> Health:
    """``answer`` as a :class:`Health`: its body parsed when it is a JSON object."""
    status, raw = answer
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        body = None
    return Health(status, body if isinstance(body, dict) else None, at)


class Prober(Protocol):
    """Health checks; must never raise for an unhealthy or unreachable backend, only return None."""

    async def check(self, address: Address, path: str, timeout_s: float, method: str = "GET") -> Answer | None: ...


class HttpProber:
    """``GET path`` (or ``HEAD``) on the backend: its status and body within ``timeout_s``, or None."""

    async def check(self, address: Address, path: str, timeout_s: float, method: str = "GET") -> Answer | None:
        try:
            return await asyncio.wait_for(self._fetch(address, path, method), timeout_s)
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError) as exc:
            log.debug("probe %s%s failed: %s", address, path, exc or type(exc).__name__)
            return None

    async def probe(self, address: Address, path: str, timeout_s: float, method: str = "GET") -> bool:
        """True only for a 200 within ``timeout_s``."""
        answer = await self.check(address, path, timeout_s, method)
        return answer is not None and answer[0] == 200

    async def _fetch(self, address: Address, path: str, method: str = "GET") -> tuple[int, bytes]:
        reader, writer, host, prefix = await _connect(address)
        try:
            head = f"{method} {prefix}{path} HTTP/1.1\r\nHost: {host}\r\n"
            if address.token is not None:
                head += f"Authorization: Bearer {address.token}\r\n"
            writer.write((head + "User-Agent: procman\r\nConnection: close\r\n\r\n").encode("latin-1"))
            await writer.drain()
            status = _status_of(await reader.readline())
            body = await _skip_rest(reader, has_body=method != "HEAD")  # read the answer before closing: no reset
            return status, body
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _status_of(line: bytes) -> int:
    parts = line.split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line: {line[:80]!r}")
    return int(parts[1])


async def _skip_rest(reader: asyncio.StreamReader, has_body: bool = True) -> bytes:
    """Read the headers and the body (up to MAX_BODY_BYTES; none for a HEAD) of an answer; the body."""
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = int(value.strip())
    return await reader.readexactly(min(length, MAX_BODY_BYTES)) if length and has_body else b""


async def _connect(address: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str, str]:
    if address.url is not None:
        url = urlsplit(address.url)
        secure = url.scheme == "https"
        port = url.port or (443 if secure else 80)
        context = ssl.create_default_context() if secure else None
        reader, writer = await asyncio.open_connection(url.hostname, port, ssl=context)
        return reader, writer, url.netloc, url.path.rstrip("/")
    if address.kind == "uds":
        reader, writer = await asyncio.open_unix_connection(address.path)
        return reader, writer, "localhost", ""
    reader, writer = await asyncio.open_connection(address.host, address.port)
    return reader, writer, f"{address.host}:{address.port}", ""
