"""The last lines a backend printed (stdout and stderr merged), kept in memory and on disk.

Log files hold prompts' errors and paths: they are created 0600 in a 0700 directory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

__all__ = ["LogBuffer"]

log = logging.getLogger(__name__)

FOLLOW_QUEUE_LINES = 10_000
MAX_FILE_BYTES = 16 * 1024 * 1024  # then <name>.log moves to <name>.log.1 and a new file begins


FILE_MODE = 0o600
DIR_MODE = 0o700


def _private_dir(path: Path) -> None:
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != DIR_MODE:
        path.chmod(DIR_MODE)


class LogBuffer:
    """A ring buffer of the last ``max_lines`` lines, also appended to ``path`` when given.

    The file is kept under ``max_file_bytes``: when it grows past it, it is renamed to
    ``<path>.1`` (replacing the previous one) and a fresh file begins.

    ``total`` counts every line ever appended, so ``since(mark)`` returns what one process
    printed even when older processes of the same backend wrote to the same buffer.
    """

    def __init__(self, path: Path | None = None, max_lines: int = 1000, max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self.path = path
        self.max_file_bytes = max_file_bytes
        self._file_bytes = 0
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._followers: set[asyncio.Queue[str]] = set()
        self._file: TextIO | None = None
        self.total = 0

    def append(self, line: str) -> None:
        """One line of output (without its newline)."""
        self._lines.append(line)
        self.total += 1
        self._write(line)
        for queue in self._followers:
            with contextlib.suppress(asyncio.QueueFull):  # a follower that does not read loses lines
                queue.put_nowait(line)

    def note(self, text: str) -> None:
        """A supervisor remark (spawned, exited) for the log file only, not the child's output."""
        self._write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} procman: {text}")

    def tail(self, n: int = 100) -> list[str]:
        """The last ``n`` lines."""
        if n <= 0:
            return []
        return list(self._lines)[-n:]

    def since(self, mark: int, n: int = 20) -> list[str]:
        """At most the last ``n`` of the lines appended after ``total`` was ``mark``."""
        fresh = min(self.total - mark, len(self._lines))
        return self.tail(min(fresh, n))

    async def follow(self, tail: int | None = None) -> AsyncIterator[str]:
        """The buffered lines (the last ``tail`` of them when given), then live lines as they come."""
        queue: asyncio.Queue[str] = asyncio.Queue(FOLLOW_QUEUE_LINES)
        self._followers.add(queue)
        try:
            for line in self.tail(len(self._lines) if tail is None else tail):
                yield line
            while True:
                yield await queue.get()
        finally:
            self._followers.discard(queue)

    def _write(self, line: str) -> None:
        if self.path is None:
            return
        try:
            if self._file is None:
                self._open(self.path)
            assert self._file is not None
            self._file.write(line + "\n")
            self._file_bytes += len(line) + 1
            if self._file_bytes > self.max_file_bytes:
                self.close()
                self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            log.warning("cannot write log %s: %s; keeping lines in memory only", self.path, exc)
            self.path = None

    def _open(self, path: Path) -> None:
        _private_dir(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)  # a file an older version left readable
        self._file = open(fd, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
        self._file_bytes = self._file.tell()

    def close(self) -> None:
        """Close the log file; later lines reopen it."""
        if self._file is not None:
            self._file.close()
            self._file = None
