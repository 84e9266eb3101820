"""UpstreamPool keeps one connection pool per live backend address: a gone process's pool is closed."""

from __future__ import annotations

from pathlib import Path

from procman import Address
from router.edge.upstream import UpstreamPool


async def test_the_pool_of_a_process_whose_socket_is_gone_is_closed(tmp_path: Path) -> None:
    pools = UpstreamPool()
    old, new = tmp_path / "m-1.sock", tmp_path / "m-2.sock"
    old.touch()
    first = pools.pool(Address(kind="uds", path=str(old)))
    old.unlink()  # the old process was released
    new.touch()
    second = pools.pool(Address(kind="uds", path=str(new)))
    assert first is not second and list(pools._pools) == [Address(kind="uds", path=str(new))]
    await pools.close()
