"""The router's store of finished Responses (``store: true``), for ``previous_response_id`` and ``GET``.

A stored response keeps the response object (what ``GET /v1/responses/{id}`` answers) and its
conversation: the input items it was asked with (a previous response's included) followed by
its output items, which is what a later request naming it as ``previous_response_id`` gets in
front of its own input. The store is bounded three ways, all under ``router:`` in the config
(read at each insert, so a reload applies at once): ``responses_store_max`` entries,
``responses_store_mb`` of JSON, and ``responses_store_ttl_s`` since the response finished; the
oldest go first. It lives in the router process: model restarts and idle stops keep it, a
router restart empties it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ResponseStore", "Stored"]


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    size: int
    expires_at: float


class ResponseStore:
    """Insertion-ordered entries; ``limits()`` returns (max entries, max bytes, ttl seconds)."""

    def __init__(self, limits: Callable[[], tuple[int, int, float]], clock: Callable[[], float] = time.monotonic):
        self._limits = limits
        self._clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its ``id``); False when it alone is over the byte limit."""
        max_count, max_bytes, ttl_s = self._limits()
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        rid = str(response["id"])
        self.delete(rid)
        if max_count <= 0 or size > max_bytes:
            return False
        self._entries[rid] = Stored(response, tuple(conversation), size, self._clock() + ttl_s)
        self.bytes += size
        self._trim(max_count, max_bytes)
        return True

    def get(self, rid: str) -> Stored | None:
        """The entry, or None when unknown, deleted, evicted or expired."""
        self._expire()
        return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None

    def _trim(self, max_count: int, max_bytes: int) -> None:
        self._expire()
        while self._entries and (len(self._entries) > max_count or self.bytes > max_bytes):
            _, entry = self._entries.popitem(last=False)
            self.bytes -= entry.size

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return
            self.delete(rid)
