"""Resuming an Anthropic Messages stream whose backend died (the OpenAI streams: :mod:`router.path.resume`).

The Messages API continues a final assistant message (a prefill), so the continuation is
the same request with the text relayed so far as that message and ``max_tokens`` less the
text deltas already sent. Its events are spliced into the first stream by
:class:`MessagesSplice`: its ``message_start`` is dropped (the client has one), so is its
``content_block_start`` when the text block is already open, and the ``message_delta`` usage
counts the tokens of both streams. Only a stream without tools is resumed (:func:`router.path.resume.plan`),
so the answer is one text block at index 0. Pure functions over bytes and dicts: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from router.path.framing import ANTHROPIC
from router.path.resume import Plan, Progress, Resumer, Splice, StreamLog, events

__all__ = ["ANTHROPIC_RESUMER", "MessagesSplice", "continuation", "progress"]


def progress(log: StreamLog) -> Progress:
    """What was relayed: the text, its deltas, whether the text block is open (``role_sent``), the end."""
    seen = Progress()
    for event in events(b"".join(log.sent)):
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "message_start":
            message = event.get("message") or {}
            seen.id, seen.model, seen.usage = message.get("id"), message.get("model"), message.get("usage")
        elif kind == "content_block_start":
            seen.role_sent = True
        elif kind == "content_block_delta" and (event.get("delta") or {}).get("type") == "text_delta":
            seen.text += event["delta"].get("text") or ""
            seen.tokens += 1
        elif kind == "message_delta":
            seen.finish = (event.get("delta") or {}).get("stop_reason") or "end_turn"
        elif kind == "message_stop":
            seen.done = True
    return seen


def continuation(p: Plan, seen: Progress) -> dict[str, Any] | None:
    """The request for the rest of the answer; None when ``max_tokens`` is spent."""
    body = dict(p.body)
    left = int(body.get("max_tokens") or p.default_max_tokens) - seen.tokens
    if left <= 0:
        return None
    messages = list(body.get("messages") or [])
    prefill = ""
    if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        prefill = _text(messages.pop()["content"])  # the client's own prefill: the answer went on from it
    body["messages"] = [*messages, {"role": "assistant", "content": prefill + seen.text}]
    body["max_tokens"] = left
    return body


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text") or "" for block in content or () if isinstance(block, dict))


class MessagesSplice(Splice):
    """Rewrites the continuation's events into the first stream."""

    __slots__ = ()

    def __init__(self, seen: Progress) -> None:
        super().__init__(seen, StreamLog(ANTHROPIC))

    def _rewrite(self, raw: bytes) -> bytes:
        out = []
        for event in events(raw):
            if not isinstance(event, dict):
                continue
            kind = event.get("type")
            if kind == "message_start" or (kind == "content_block_start" and self.seen.role_sent):
                continue
            if kind == "message_delta":
                event = self._counted(event)
            data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            out.append(f"event: {kind}\ndata: {data}\n\n".encode())
        return b"".join(out)

    def _counted(self, event: dict[str, Any]) -> dict[str, Any]:
        """Usage over both streams: the continuation's prompt held the text already sent."""
        usage = dict(event.get("usage") or {})
        usage["output_tokens"] = int(usage.get("output_tokens") or 0) + self.seen.tokens
        if usage.get("input_tokens") is not None:
            first = self.seen.usage or {}
            if first.get("input_tokens"):  # the first stream's prompt, split as it was into uncached and cache reads
                usage["input_tokens"] = first["input_tokens"]
                if "cache_read_input_tokens" in usage or "cache_read_input_tokens" in first:
                    usage["cache_read_input_tokens"] = int(first.get("cache_read_input_tokens") or 0)
            else:
                usage["input_tokens"] = max(int(usage["input_tokens"]) - self.seen.tokens, 0)
        return {**event, "usage": usage}


ANTHROPIC_RESUMER = Resumer(progress, continuation, MessagesSplice)
