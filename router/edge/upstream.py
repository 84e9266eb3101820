"""How the router talks to its backends: the :class:`Upstream` protocol and its real pool.

The proxy and the service take an ``Upstream`` (injected, like httpx's transport), so router
tests run every proxy behaviour in-process against a fake (``tests/router_fakes.py``)
without a model process. :class:`UpstreamPool` is the real one: a keep-alive
:class:`~router.edge.httpclient.ConnectionPool` per backend address, created on first use and
closed when the router stops. See :mod:`router.edge.httpclient` for why the client is our own
thin layer over httptools.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Protocol

from procman import Address
from router.edge.heartbeat import Watch
from router.edge.httpclient import ConnectionPool

__all__ = ["Upstream", "UpstreamPool", "UpstreamReply"]

CONNECT_TIMEOUT_S = 5.0


class UpstreamReply(Protocol):
    """A response whose head arrived; the body follows. ``close()`` (always) frees the connection."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    complete: bool

    @property
    def content_length(self) -> int | None: ...

    def header(self, name: bytes) -> bytes | None: ...

    def iter_chunks(self, idle_timeout_s: float | None = None) -> AsyncIterator[bytes]: ...

    async def read(self, idle_timeout_s: float | None = None) -> bytes: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    """One HTTP exchange with the backend at ``address``; raises UpstreamError / UpstreamTimeout, and
    UpstreamHung when the heartbeats ``watch`` asks for (router/edge/heartbeat.py) stop or stand still."""

    async def request(
        self,
        address: Address,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        head_timeout_s: float | None,
        watch: Watch | None = None,
    ) -> UpstreamReply: ...

    async def close(self) -> None: ...


class UpstreamPool:
    """Connection pools by backend address. Owned by the app's lifespan; ``close()`` ends them all."""

    def __init__(self) -> None:
        self._pools: dict[Address, ConnectionPool] = {}

    async def request(
        self,
        address: Address,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        head_timeout_s: float | None,
        watch: Watch | None = None,
    ) -> UpstreamReply:
        if address.token is not None:  # a process on a node requires its own token (the client's was dropped)
            headers = [*headers, ("authorization", f"Bearer {address.token}")]
        return await self.pool(address).request(method, path, headers, body, head_timeout_s=head_timeout_s,
                                                watch=watch)

    def pool(self, address: Address) -> ConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            self._prune()
            if address.kind == "uds":
                pool = ConnectionPool(uds=address.path, connect_timeout_s=CONNECT_TIMEOUT_S)
            else:
                pool = ConnectionPool(url=address.base_url, connect_timeout_s=CONNECT_TIMEOUT_S)
            self._pools[address] = pool
        return pool

    def _prune(self) -> None:
        """Close the pools of processes that are gone (each process has its own socket; a gone one's file is too)."""
        for address in [a for a in self._pools if a.kind == "uds" and a.path and not os.path.exists(a.path)]:
            self._pools.pop(address).close()

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
