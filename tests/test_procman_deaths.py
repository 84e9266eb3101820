"""procman/deaths.py as tables: how a death is classified, recorded and judged (one policy for procman and the
router), and when the owner answers a caller (machine.answered / settled / plain)."""

from __future__ import annotations

import signal

import pytest

from procman import deaths
from procman import machine as m
from procman.deaths import Death
from procman.machine import Counters
from procman.states import State

S = State
KILL, SEGV, TERM = -signal.SIGKILL, -signal.SIGSEGV, -signal.SIGTERM
PATTERNS = ("CL_OUT_OF_RESOURCES",)


@pytest.mark.parametrize(
    ("code", "tail", "in_flight", "expected"),
    [
        (1, ["Traceback"], 1, Death("crash", 1, 1, blamed=True)),  # alone in a process that crashed by itself
        (SEGV, [], 1, Death("crash", SEGV, 1, blamed=True)),  # a segfault is its own doing
        (1, [], 2, Death("crash", 1, 2)),  # shared: nobody alone
        (1, [], 0, Death("crash", 1, 0)),  # an idle process: no request to blame
        (KILL, [], 1, Death("crash", KILL, 1)),  # kill -9 from outside
        (TERM, [], 1, Death("crash", TERM, 1)),
        (134, ["cl_out_of_resources"], 1, Death("fatal", 134, 1)),  # the device failed, not the request
    ],
)
def test_an_exit_is_classified_and_judged(code: int, tail: list[str], in_flight: int, expected: Death) -> None:
    assert deaths.of_exit(code, tail, PATTERNS, in_flight) == expected


def test_a_hang_is_blamed_on_a_lone_request_only() -> None:
    assert deaths.of_hang(1) == Death("hang", None, 1, blamed=True)
    assert deaths.of_hang(0) == Death("hang", None, 0) and deaths.of_hang(3) == Death("hang", None, 3)


def test_a_hang_of_a_process_stopped_by_sigstop_is_from_outside() -> None:
    stopped = deaths.of_hang(1, stopped=True)
    assert stopped == Death("hang", -signal.SIGSTOP, 1) and deaths.external(stopped) and deaths.innocent(stopped)


@pytest.mark.parametrize(
    ("state", "event", "expected"),
    [
        (S.READY, m.Exited(5, "crash", blamed=True), Death("crash", 3, 1, blamed=True)),
        (S.READY, m.Exited(4), None),  # an older process: not this one's death
        (S.STOPPING, m.Exited(5), None),  # being stopped anyway
        (S.READY, m.Hung(5), Death("hang", None, 1, blamed=True)),  # judged when taken, by the count then
        (S.READY, m.Hung(5, outside=True), Death("hang", -signal.SIGSTOP, 1)),  # found stopped: from outside
        (S.READY, m.Restart("hang", 5, outside=True), Death("hang", -signal.SIGSTOP, 1)),
        (S.READY, m.Hung(4), None),
        (S.READY, m.Restart("fatal", 5), Death("fatal", None, 1)),
        (S.READY, m.Restart("fatal"), Death("fatal", None, 1)),  # no generation: the current process
        (S.READY, m.Restart("hang", 4), None),  # someone else restarted it already
        (S.READY, m.Restart("manual"), None),  # a manual restart is no death
        (S.READY, m.Want(True), None),
        (S.STARTING, m.Restart("crash"), None),
    ],
)
def test_what_an_event_records(state: State, event: m.Event, expected: Death | None) -> None:
    assert deaths.recorded(state, event, 5, 1, 3 if isinstance(event, m.Exited) else None) == expected


def test_forgiving_takes_only_deaths_counted_as_failures() -> None:
    known = {1: Death("crash", 1, 2), 2: Death("crash", 1, 1, blamed=True), 4: Death("hang", None, 3),
             5: Death("hang", -signal.SIGSTOP, 2)}
    assert deaths.forgivable(known, [4, 2, 1, 3, 1, 5]) == [1, 4]


def test_every_death_counts_toward_the_backoff_but_a_poison_and_a_stop_from_outside() -> None:
    assert deaths.counted(Death("crash", KILL, 1)) and deaths.counted(Death("crash", TERM, 2))  # kill -9, OOM
    assert deaths.counted(Death("hang", None, 2)) and deaths.counted(Death("fatal", None, 1))
    assert not deaths.counted(Death("crash", 1, 1, blamed=True))
    assert not deaths.counted(deaths.of_hang(1, stopped=True)) and not deaths.counted(deaths.of_hang(3, stopped=True))


def test_innocent_is_the_one_policy() -> None:
    assert deaths.innocent(Death("stall", None, 1)) and deaths.innocent(Death("fatal", None, 1))
    assert deaths.external(Death("crash", KILL, 1)) and not deaths.external(Death("hang", KILL, 1))
    assert not deaths.innocent(Death("crash", 1, 1)) and not deaths.innocent(Death("hang", None, 1))


def test_a_want_hears_of_a_death_first() -> None:
    assert deaths.heard_first(S.READY, m.Want(True), exited=True)
    assert not deaths.heard_first(S.READY, m.Done(), exited=True)
    assert not deaths.heard_first(S.READY, m.Want(True), exited=False)
    assert not deaths.heard_first(S.STOPPING, m.Want(True), exited=True)


@pytest.mark.parametrize(
    ("event", "answer"),
    [
        (m.Want(True), "decision"), (m.Stop(), "settled"), (m.Close(), "settled"), (m.Restart(), "settled"),
        (m.Update(), "settled"), (m.Retune(), "settled"), (m.Done(), "turn"), (m.Forgive(), "turn"),
        (m.KeepAlive(0.0), "turn"), (m.Reaped(), "turn"),
    ],
)
def test_when_a_caller_is_answered(event: m.Event, answer: str) -> None:
    assert m.answered(event) == answer


def test_commands_settle_in_a_resting_state_with_no_drain() -> None:
    assert m.settled(S.READY, Counters()) and m.settled(S.BACKOFF, Counters()) and m.settled(S.STOPPED, Counters())
    assert not m.settled(S.READY, Counters(in_flight=1, draining=True))
    assert not m.settled(S.STARTING, Counters()) and not m.settled(S.STOPPING, Counters())


def test_plain_answers_are_an_admit_with_room_and_a_done_with_others_in_flight() -> None:
    c = Counters(generation=1, in_flight=2)
    admit = m.decide(S.READY, m.Want(True), c, m.Policy(), 0.0)
    assert m.plain(m.Want(True), admit)
    assert m.plain(m.Done(), m.decide(S.READY, m.Done(), c, m.Policy(), 0.0))
    last = m.decide(S.READY, m.Done(), c._replace(in_flight=1), m.Policy(idle_timeout_s=60.0), 0.0)
    assert not m.plain(m.Done(), last)  # it arms the idle timer: the owner's way
    parked = m.decide(S.READY, m.Want(True), c._replace(draining=True), m.Policy(), 0.0)
    assert not m.plain(m.Want(True), parked)
