"""router.api.events: fan-out, kind filters, bounded queues, SSE encoding."""

from __future__ import annotations

import asyncio
import json

from router.api.events import EventBus, sse_comment


async def test_every_subscriber_gets_every_event_in_order() -> None:
    bus = EventBus()
    async with bus.subscribe() as a, bus.subscribe() as b:
        assert bus.subscribers == 2
        bus.publish("state", {"model": "m", "state": "starting"})
        bus.publish("state", {"model": "m", "state": "ready"})
        for sub in (a, b):
            first, second = await sub.get(), await sub.get()
            assert (first.data["state"], second.data["state"]) == ("starting", "ready")
            assert second.id == first.id + 1
    assert bus.subscribers == 0


async def test_kinds_filter_what_a_subscriber_sees() -> None:
    bus = EventBus()
    async with bus.subscribe({"request"}) as sub:
        bus.publish("state", {"model": "m"})
        bus.publish("request", {"model": "m", "status": 200})
        event = await asyncio.wait_for(sub.get(), 1)
        assert event.kind == "request"
        assert sub.pending() == 0


async def test_a_slow_subscriber_gets_resync_instead_of_blocking_others() -> None:
    bus = EventBus(queue_size=3)
    async with bus.subscribe() as slow, bus.subscribe() as fast:
        for i in range(3):
            bus.publish("tick", {"i": i})
        for _ in range(3):
            await fast.get()
        bus.publish("tick", {"i": 3})  # slow's queue is full: it is emptied and told how much it lost
        resync = await slow.get()
        assert resync.kind == "resync" and resync.data["lost"] == 4
        assert slow.pending() == 0
        assert (await fast.get()).data == {"i": 3}


def test_sse_encoding_is_one_event_with_json_data() -> None:
    bus = EventBus()
    event = bus.publish("state", {"model": "m", "text": "a\nb"})
    lines = event.sse().decode().split("\n")
    assert lines[0] == f"id: {event.id}" and lines[1] == "event: state"
    assert json.loads(lines[2].removeprefix("data: ")) == {"model": "m", "text": "a\nb"}
    assert lines[3:] == ["", ""]
    assert sse_comment("loading m 1.0s") == b": loading m 1.0s\n\n"
