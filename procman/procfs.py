"""Figures the Linux kernel gives in ``/proc``: a process's memory (``VmRSS``, ``VmHWM``) and the like.

One reader for procman (a spare interpreter's size) and the router (the console, the memory watch,
physical memory for ``memory_budget: auto``). No project imports.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["proc_bytes", "process_memory_bytes"]


def proc_bytes(path: Path, key: str) -> int | None:
    """The ``key:  N kB`` line of a ``/proc`` status file in bytes; None off Linux, once it is gone, or if absent."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_memory_bytes(pid: int | None, key: str = "VmRSS") -> int | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of process ``pid`` in bytes; None when unknown."""
    return proc_bytes(Path(f"/proc/{pid}/status"), key) if pid else None
