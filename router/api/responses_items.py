"""Stored input items as ``GET /v1/responses/{id}/input_items`` lists them (pure functions).

A client sends input items loosely (a bare string, ``{"role": "user", "content": "hi"}``, no
ids); OpenAI lists them as item *resources*: every item has an ``id`` and a ``status``, a
message's ``content`` is a list of parts (``input_text`` for user, system and developer turns,
``output_text`` with ``annotations`` and ``logprobs`` for assistant turns). :func:`with_ids`
gives the items their ids once, when the response is stored, so that an item keeps its id in
every later response that continues the conversation (and a cursor stays valid);
:func:`listed` writes one item as a resource; :func:`page` is the list endpoint's cursor page
(``order`` ``desc`` by default, ``limit`` 1..100, default 20, ``after`` an item id).
"""

from __future__ import annotations

from typing import Any

from router.edge.errors import BadRequest

__all__ = ["listed", "page", "with_ids"]

_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "custom_tool_call": "ctc",
             "custom_tool_call_output": "ctco"}
_INPUT_PARTS = frozenset({"input_text", "input_image", "input_file"})


def with_ids(items: list[dict[str, Any]], response_id: str) -> list[dict[str, Any]]:
    """``items`` with an ``id`` on each that has none, derived from the response that first stored it."""
    suffix = response_id.removeprefix("resp_")
    return [item if isinstance(item.get("id"), str) else
            {**item, "id": f"{_PREFIXES.get(_kind(item), 'item')}_{suffix}_in{index}"}
            for index, item in enumerate(items)]


def _kind(item: dict[str, Any]) -> str:
    return str(item.get("type") or ("message" if "role" in item else "item"))


def listed(item: dict[str, Any]) -> dict[str, Any]:
    """One stored item as an item resource: ``type`` and ``status`` set, a message's content as parts."""
    resource = {**item, "type": _kind(item)}
    resource.setdefault("status", "completed")
    if resource["type"] == "message":
        resource["content"] = _parts(item.get("content"), assistant=item.get("role") == "assistant")
    return resource


def _parts(content: Any, assistant: bool) -> list[dict[str, Any]]:
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return []
    if assistant:
        return [{"type": "output_text", "text": str(part.get("text") or ""), "annotations": [], "logprobs": []}
                for part in parts if isinstance(part, dict) and "text" in part]
    return [part if part.get("type") in _INPUT_PARTS else {"type": "input_text", "text": str(part.get("text") or "")}
            for part in parts if isinstance(part, dict)]


def page(items: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """The list body for ``query`` (``order``, ``limit``, ``after``); 400 naming a bad parameter."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest(f"order: expected 'asc' or 'desc', got {order[:20]!r}", param="order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit: expected an integer from 1 to 100, got {query.get('limit', '')[:20]!r}",
                         param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if (after := query.get("after")) is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise BadRequest(f"after: no item {after[:100]!r} in this response's input", param="after")
        start = ids.index(after) + 1
    data = [listed(item) for item in ordered[start:start + limit]]
    return {"object": "list", "data": data, "has_more": start + limit < len(ordered),
            "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
