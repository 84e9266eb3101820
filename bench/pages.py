"""Resident memory of a set of processes counted once per page, and one process's memory by mapping (Linux).

A page that several processes map (the Python binary, libc, the OpenVINO libraries a
router's spare and its model server both load) is one page of RAM, so the memory a set
of processes holds is the *union* of their resident pages, not the sum of their RSS.
:func:`union` reads it exactly from ``/proc/PID/pagemap`` — the physical frame number of
every resident page, readable by root — and falls back to the sum of PSS (each shared page
split between its sharers: exact for the whole system, an approximation for a subset)
where pagemap gives no frame numbers. :func:`breakdown` splits one process's RSS by what
is mapped (anonymous memory, the Python binary, each library or package, the model's files).
"""

from __future__ import annotations

import os
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Status", "Union", "breakdown", "category", "resident_frames", "status", "union"]

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRESENT = 1 << 63
_PFN_MASK = (1 << 55) - 1
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


@dataclass(frozen=True, slots=True)
class Status:
    """``/proc/PID/status`` figures in MiB: resident now, its peak, and resident anonymous / file-backed."""

    rss: float
    hwm: float
    anon: float
    file: float


@dataclass(frozen=True, slots=True)
class Union:
    """What a set of processes holds: ``mib`` counted once per page, by ``method`` (``pagemap`` | ``pss``)."""

    mib: float
    rss_sum: float
    method: str


def status(pid: int) -> Status:
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) / 1024
    return Status(fields.get("VmRSS", 0.0), fields.get("VmHWM", 0.0), fields.get("RssAnon", 0.0),
                  fields.get("RssFile", 0.0) + fields.get("RssShmem", 0.0))


def _vmas(pid: int) -> Iterator[tuple[int, int, str, dict[str, int]]]:
    """``(start, end, path, {field: kB})`` of each mapping in ``/proc/PID/smaps``."""
    current: tuple[int, int, str] | None = None
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = _HEADER.match(line)
        if head:
            if current is not None:
                yield (*current, fields)
            current, fields = (int(head[1], 16), int(head[2], 16), head[3]), {}
        elif line.endswith(" kB"):
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0])
    if current is not None:
        yield (*current, fields)


def resident_frames(pid: int) -> set[int] | None:
    """The physical frame numbers of ``pid``'s resident pages; None where pagemap hides them (not root)."""
    frames: set[int] = set()
    hidden = True
    with open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for start, end, _path, fields in _vmas(pid):
            if not fields.get("Rss"):
                continue
            pagemap.seek(start // PAGE * 8)
            entries = array("Q")
            entries.frombytes(pagemap.read((end - start) // PAGE * 8))
            for entry in entries:
                if entry & _PRESENT:
                    frame = entry & _PFN_MASK
                    hidden = hidden and frame == 0
                    frames.add(frame)
    return None if hidden and frames else frames


def union(pids: Iterable[int]) -> Union:
    """The resident memory of ``pids`` together, each page once (pagemap), else the sum of their PSS."""
    pids = list(pids)
    rss_sum = sum(status(pid).rss for pid in pids)
    frames: set[int] = set()
    try:
        for pid in pids:
            own = resident_frames(pid)
            if own is None:
                raise PermissionError("pagemap hides frame numbers")
            frames |= own
    except OSError:
        pss = sum(sum(f.get("Pss", 0) for *_, f in _vmas(pid)) for pid in pids) / 1024
        return Union(pss, rss_sum, "pss")
    return Union(len(frames) * PAGE / MIB, rss_sum, "pagemap")


def category(path: str) -> str:
    """What a mapping is, for :func:`breakdown`: anonymous, a stack, the Python binary, a library, a package."""
    if not path or path == "[heap]" or path.startswith("[anon"):
        return "anonymous (heap, arenas, thread stacks)"
    if path.startswith("["):
        return path
    name = os.path.basename(path.removesuffix(" (deleted)"))
    if "site-packages/" in path:
        package = path.split("site-packages/", 1)[1].split("/", 1)[0]
        return f"package {package.split('.libs')[0]}"
    if name.startswith(("python", "libpython")):
        return "python binary"
    if ".so" in name:
        return "system library " + name.split(".so")[0]
    return "file " + name


def breakdown(pid: int) -> dict[str, float]:
    """``pid``'s RSS by :func:`category`, in MiB, largest first."""
    totals: Counter[str] = Counter()
    for _start, _end, path, fields in _vmas(pid):
        totals[category(path)] += fields.get("Rss", 0) / 1024
    return dict(totals.most_common())
