"""Giving back what a model server holds but no longer uses once its model has answered (Linux; no OpenVINO).

OpenVINO memory-maps an IR's ``.bin`` read-only and, on the CPU, copies the weights into its
own layout for its kernels at the first inference. The mapped pages it read stay in the
process's resident set afterwards, a second copy of the weights counted against the model
(SmolLM2-135M Q4_1: 86 MiB mapped, of which ~18 MiB — the token embeddings, used in place —
are ever read again). :func:`release_file_pages` drops those pages from the process (every
read-only shared file mapping, ``madvise(MADV_DONTNEED)``): such a mapping only ever holds
the page cache's clean pages, and a page read again is faulted back in from the file, so
nothing can change or be lost; what is read again comes back, what is not stays out. :func:`trim_heap` returns the
heap's free pages to the OS (glibc ``malloc_trim``: the load's temporary buffers).

:class:`Settle` does both once, after the model's first answer (the weights' copy is made by then).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["MADV_DONTNEED", "Settle", "read_only_file_mappings", "release_and_trim", "release_file_pages", "trim_heap"]

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
MIB = 1024 * 1024

Madvise = Callable[[int, int, int], int]


def read_only_file_mappings(maps: str) -> Iterator[tuple[int, int, str]]:
    """``(start, end, path)`` of each read-only *shared* file mapping in ``/proc/<pid>/maps`` text (``r--s``).

    Only shared ones: their pages are the page cache's, never a private copy. A read-only
    private mapping may hold pages written before it was made read-only (a library's
    relocations), which dropping would undo."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1] != "r--s" or not fields[5].startswith("/"):
            continue
        start, end = (int(value, 16) for value in fields[0].split("-"))
        yield start, end, fields[5]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, once. ``libc.so.6`` by name: ``ctypes.util.find_library`` would run ``ldconfig -p`` in a
    child process (a fork of the whole model server) at every call, right after the model's first answer."""
    if not sys.platform.startswith("linux"):
        return None
    for name in ("libc.so.6", None):  # None: the symbols already loaded in this process (libc among them)
        try:
            return ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
    return None


def _madvise() -> Madvise | None:
    libc = _libc()
    if libc is None:
        return None
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def release_file_pages(maps_path: Path = Path("/proc/self/maps"), madvise: Madvise | None = None) -> int:
    """Drop the resident pages of this process's read-only file mappings; the bytes of mappings released."""
    try:
        maps = maps_path.read_text()
    except OSError:
        return 0
    madvise = madvise or _madvise()
    if madvise is None:
        return 0
    released = 0
    for start, end, _path in read_only_file_mappings(maps):
        if madvise(start, end - start, MADV_DONTNEED) == 0:
            released += end - start
    return released


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc); False where there is no ``malloc_trim``."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


def release_and_trim(release: Callable[[], int] = release_file_pages, trim: Callable[[], bool] = trim_heap) -> int:
    """:func:`release_file_pages` then :func:`trim_heap`; the bytes of mappings released."""
    released = release()
    trim()
    return released


class Settle:
    """Once, after the first answer: :func:`release_file_pages` and :func:`trim_heap` (see the module's note)."""

    def __init__(self, name: str, release: Callable[[], int] = release_file_pages,
                 trim: Callable[[], bool] = trim_heap) -> None:
        self._name = name
        self._release = release
        self._trim = trim
        self.done = False

    def after_answer(self) -> None:
        if self.done:
            return
        self.done = True
        released = release_and_trim(self._release, self._trim)
        log.info("%s answered: dropped the resident pages of %d MiB of read-only file mappings (the weights as "
                 "stored; what is read again comes back) and trimmed the heap", self._name, released // MIB)
