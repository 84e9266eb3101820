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
    at a time gives U+FFFD. Each push decodes a short window that starts a few tokens back
    (so a leading-space rule of the tokenizer sees the same context as a full decode) and
    emits the new text only once it no longer ends in U+FFFD (the vLLM prefix/read offsets).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids up to here are already emitted as text

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
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]


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

    def push(self, text: str) -> str:
        """Add ``text``; return what is safe to emit. After a match, :attr:`stopped` is True."""
        if self.stopped:
            return ""
        buffer = self._pending + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.stopped = True
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
