"""The router's bounded store of finished Responses (pure: a fake clock, no router)."""

from __future__ import annotations

from typing import Any

from router.api.responses_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def response(rid: str, text: str = "x") -> dict[str, Any]:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": text}]}


def store(count: int = 10, size: int = 1 << 20, ttl_s: float = 60.0, clock: Clock | None = None) -> ResponseStore:
    return ResponseStore(lambda: (count, size, ttl_s), clock or Clock())


def test_the_oldest_go_first_past_the_count() -> None:
    kept = store(count=2)
    for rid in ("a", "b", "c"):
        assert kept.put(response(rid), [])
    assert kept.get("a") is None and kept.get("b") is not None and len(kept) == 2


def test_the_byte_limit_evicts_and_refuses_one_too_large() -> None:
    kept = store(size=350)
    assert kept.put(response("a", "x" * 100), [{"role": "user", "content": "hi"}])
    assert kept.put(response("b", "y" * 100), [])
    assert kept.get("a") is None and kept.get("b") is not None  # a and b together are over 350 bytes
    assert not kept.put(response("c", "z" * 1000), []) and kept.get("c") is None
    assert kept.bytes == kept.get("b").size  # type: ignore[union-attr]


def test_an_entry_expires_after_its_ttl_and_delete_drops_it() -> None:
    clock = Clock()
    kept = store(ttl_s=10, clock=clock)
    kept.put(response("a"), [{"role": "user", "content": "hi"}])
    kept.put(response("b"), [])
    stored = kept.get("a")
    assert stored is not None and stored.conversation == ({"role": "user", "content": "hi"},)
    assert kept.delete("b") and not kept.delete("b")
    clock.now = 10.5
    assert kept.get("a") is None and kept.bytes == 0


def test_count_zero_stores_nothing() -> None:
    kept = store(count=0)
    assert not kept.put(response("a"), []) and kept.get("a") is None
