"""The router's coalescing transport: same-iteration writes become one, nothing is lost."""

from __future__ import annotations

import asyncio
from typing import Any

from router.edge.coalesce import CoalescingTransport


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "write after close"
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


async def test_writes_of_one_iteration_go_out_as_one() -> None:
    real = FakeTransport()
    transport = CoalescingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"")
    transport.write(b"body")
    assert real.writes == []
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    transport.write(b"chunk")  # a later iteration: its own write
    await asyncio.sleep(0)
    assert real.writes[-1] == b"chunk" and len(real.writes) == 2


async def test_close_flushes_first_and_other_calls_pass_through() -> None:
    real = FakeTransport()
    transport = CoalescingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"last words")
    transport.close()
    assert real.writes == [b"last words"] and real.closed
    await asyncio.sleep(0)  # the scheduled flush finds nothing left and writes nothing after close
    assert real.writes == [b"last words"]
    assert transport.get_extra_info("peername") == ("127.0.0.1", 1)
