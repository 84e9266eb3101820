"""``ovrouter status``'s table (router/statustable.py): pure, from /api/models rows."""

from __future__ import annotations

from typing import Any

from router.statustable import status_table

CRASH = "m pid=41 exited unexpectedly with code -9 (SIGKILL); last log lines:\nboom"


def row(**fields: Any) -> dict[str, Any]:
    return {"name": "m", "state": "ready", "pid": 42, **fields}


def last_column(**fields: Any) -> str:
    header, line = status_table([row(**fields)], now=1000.0).splitlines()
    return line[header.index("LAST"):]


def test_a_fault_shows_its_error_on_one_line() -> None:
    crash = last_column(last_reason="restart:crash", last_error=CRASH)
    assert crash.startswith("restart:crash: m pid=41 exited unexpectedly with code -9 (SIGKILL)")
    assert "boom" not in crash and len(crash) <= 70  # the first line only, cut to the column
    assert last_column(last_reason="failed start:cold", last_error="weights are corrupt") == (
        "failed start:cold: weights are corrupt")


def test_an_error_is_not_shown_beside_a_later_clean_stop_or_start() -> None:
    assert last_column(state="stopped", pid=None, last_reason="stop:unload", last_error=CRASH) == "stop:unload"
    assert last_column(last_reason="start:cold", last_error=CRASH) == "start:cold"


def test_an_error_without_a_reason_is_shown() -> None:
    assert last_column(last_error="weights are corrupt") == "weights are corrupt"
