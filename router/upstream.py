"""The router's connections to its backends: one keep-alive pool per backend address.

Pools are created on first use and closed when the router stops. See
:mod:`router.httpclient` for why the client is our own thin layer over httptools.
"""

from __future__ import annotations

from procman import Address
from router.httpclient import ConnectionPool

__all__ = ["UpstreamPool"]

CONNECT_TIMEOUT_S = 5.0


class UpstreamPool:
    """Connection pools by backend address. Owned by the app's lifespan; ``close()`` ends them all."""

    def __init__(self) -> None:
        self._pools: dict[Address, ConnectionPool] = {}

    def pool(self, address: Address) -> ConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            if address.kind == "uds":
                pool = ConnectionPool(uds=address.path, connect_timeout_s=CONNECT_TIMEOUT_S)
            else:
                pool = ConnectionPool(url=address.base_url, connect_timeout_s=CONNECT_TIMEOUT_S)
            self._pools[address] = pool
        return pool

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
