"""The compact models table ``ovrouter status`` prints, from ``GET /api/models`` rows (no heavy imports)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["status_table"]

COLUMNS = (("MODEL", "<20"), ("STATE", "<9"), ("PID", ">7"), ("UP", ">6"), ("RSS", ">8"), ("IN", ">3"), ("Q", ">3"),
           ("RESTARTS", ">12"), ("REQ/MIN", ">7"), ("TTFT50", ">7"), ("TOK/S", ">6"), ("IDLE", ">6"))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _bytes(n: int | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit in ("B", "K") else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return "-"


def _restarts(row: dict[str, Any]) -> str:
    total = row.get("restarts", 0) or 0
    reasons = row.get("restarts_by_reason") or {}
    if not reasons:
        return str(total)
    return f"{total} " + ",".join(f"{k}:{v}" for k, v in sorted(reasons.items()))


#: The last reasons a model's ``last_error`` belongs to; after any other (a clean start or stop) it is history.
FAULT_REASONS = ("failed start:", "restart:crash", "restart:fatal", "restart:hang")


def _last(row: dict[str, Any]) -> str:
    """The last reason, with the error only when that reason was the fault (never a stale one after an unload);
    a start waiting for room says why instead."""
    if row.get("waiting"):
        return str(row["waiting"])
    reason = row.get("last_reason") or ""
    error = (row.get("last_error") or "").split("\n", 1)[0] if not reason or reason.startswith(FAULT_REASONS) else ""
    return (f"{reason}: {error}" if reason and error else error or reason)[:70]


def status_table(rows: list[dict[str, Any]], now: float | None = None) -> str:
    """One line per model: state, pid, uptime, memory, load, restarts (by reason), speed, last reason/error."""
    now = time.time() if now is None else now
    lines = [" ".join(f"{name:{fmt}}" for name, fmt in COLUMNS) + "  LAST"]
    for row in rows:
        idle = now - row["last_used"] if row.get("last_used") else None
        tps = row.get("tokens_per_s")
        cells = (
            row["name"], str(row["state"]).lower(), row.get("pid") or "-", _duration(row.get("uptime_s")),
            _bytes(row.get("rss_bytes")), row.get("in_flight", 0), row.get("queued", 0), _restarts(row),
            row.get("requests_per_min", "-"), _duration(row.get("ttft_p50_s")), f"{tps:.0f}" if tps else "-",
            _duration(idle),
        )
        lines.append(" ".join(f"{str(cell):{fmt}}" for cell, (_, fmt) in zip(cells, COLUMNS, strict=True))
                     + "  " + _last(row))
    return "\n".join(lines)
