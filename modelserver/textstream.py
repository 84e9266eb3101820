"""Pure text-stream logic, no engine imports: incremental detokenization and stop strings.

Both pieces are fed small increments and return only text that is final, so what a
client receives in a stream is exactly what it would receive in one non-streamed body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopMatcher"]

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    A byte-level tokenizer may spread one character over several tokens; decoding them one
    at a time gives U+FFFD. Each push decodes the ids of a window that starts a few tokens
    back (so a tokenizer's leading-space rule sees the same context as a full decode) and
    emits the new end of that text once it no longer ends in U+FFFD. The window slides
    forward every ``window`` tokens, so a push costs one decode of at most ``window`` +
    ``context`` ids, plus one more decode per slide.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], window: int = 16, context: int = 4) -> None:
        self._decode = decode
        self._window = window
        self._context = context
        self._ids: list[int] = []
        self._start = 0  # the decode window starts here
        self._read = 0  # ids before this index are emitted as text
        self._emitted = 0  # characters of decode(ids[start:read]) already emitted

    @property
    def token_count(self) -> int:
        return len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids`` and return the text that became final (possibly empty)."""
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the generation, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._start :])
        if len(text) <= self._emitted or (text.endswith(REPLACEMENT) and not final):
            return ""
        delta = text[self._emitted :]
        self._read, self._emitted = len(self._ids), len(text)
        if self._read - self._start > self._window:
            self._start = self._read - self._context
            self._emitted = len(self._decode(self._ids[self._start : self._read]))
        return delta


class StopMatcher:
    """Cuts a text stream at the first stop string, never leaking part of one.

    Text that could be the start of a stop string is held back until the next push shows
    whether the stop string completes (then the text ends before it) or not (then the held
    text is released). Invariant: no stop string starts inside text already returned.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        """Add ``text``; return what is safe to emit. After a match, :attr:`stopped` is True."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.stopped = True
            self.matched = min(self._stops, key=lambda stop: (i if (i := buffer.find(stop)) >= 0 else len(buffer)))
            self._pending = ""
            return buffer[:cut]
        hold = self._held_suffix(buffer)
        self._pending = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        """The held-back text once the stream ended without completing a stop string."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped else pending

    def _first_match(self, buffer: str) -> int | None:
        found = [i for i in (buffer.find(stop) for stop in self._stops) if i >= 0]
        return min(found) if found else None

    def _held_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
