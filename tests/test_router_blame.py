"""Whose fault a death was (router/path/blame.py): one row per rule."""

from __future__ import annotations

import signal

import pytest

from procman.deaths import Death
from router.path.blame import verdict

SEGV, KILL, STOP = -int(signal.SIGSEGV), -int(signal.SIGKILL), -int(signal.SIGSTOP)


@pytest.mark.parametrize(
    ("death", "second", "streaming", "expected"),
    [
        (Death("crash", 86, in_flight=1), False, False, "blame"),  # alone in a process that crashed: poison
        (Death("crash", SEGV, in_flight=1), False, True, "blame"),  # a segfault is not an external signal
        (Death("crash", 86, in_flight=3), False, False, "again"),  # others were in flight too
        (Death("crash", KILL, in_flight=1), False, False, "again"),  # kill -9 from outside
        (Death("crash", KILL, in_flight=1), False, True, "again"),  # ... a stream is resumed
        (Death("fatal", -9, in_flight=1), False, False, "again"),  # the device failed, not the request
        (Death("stall", -9, in_flight=1), False, True, "again"),
        (Death("hang", -9, in_flight=1), False, False, "blame"),  # a lone request that hung its process
        (Death("hang", -9, in_flight=2), False, False, "again"),  # a shared hang: retried as a suspect, alone
        (Death("hang", -9, in_flight=2), False, True, "again"),  # a stream under way is resumed
        (Death("hang", -9, in_flight=1), False, True, "again"),  # ... even alone: its tokens were flowing
        (Death("hang", STOP, in_flight=1), False, False, "again"),  # SIGSTOPped from outside: not its doing
        (Death("hang", STOP, in_flight=1), True, False, "again"),
        (Death("crash", 86, in_flight=1), True, False, "blame"),  # its second process down alone: the cause
        (Death("crash", 86, in_flight=3), True, False, "again"),  # shared: a neighbour may be the cause
        (Death("fatal", -9, in_flight=2), True, False, "again"),
        (Death("fatal", -9, in_flight=1), True, True, "blame"),
        (Death("crash", KILL, in_flight=1), True, False, "again"),  # killed from outside twice: not its doing
        (Death("hang", -9, in_flight=3), True, True, "again"),  # a resumed stream caught again beside others
        (Death("crash", 86, in_flight=1), True, True, "blame"),  # ... but alone: it is the cause
    ],
)
def test_verdict(death: Death, second: bool, streaming: bool, expected: str) -> None:
    assert verdict(death, second=second, streaming=streaming) == expected
