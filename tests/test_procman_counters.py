"""The flags of ``Counters`` hold only in the states the machine allows (``machine.FLAGS``, ``counters_ok``).

Every (state, counters) that ``decide()`` reaches — from every row of the state table (procman/table.py)
and on seeded random walks over the events a backend can receive — must be one ``counters_ok`` accepts.
A follow-up (``FollowUp``) is decided at once, as the backend does, and its intermediate state counts too.
Then the edges whose flags used to outlive their state, one test each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
from procman_fakes import Harness

from procman import State
from procman.machine import (
    FLAGS,
    Close,
    Counters,
    Decision,
    Done,
    DrainTimeout,
    Event,
    Exited,
    FailParked,
    FollowUp,
    Forgive,
    Hung,
    IdleTick,
    KeepAlive,
    Policy,
    Reaped,
    Restart,
    RetryDue,
    Retune,
    Started,
    Stop,
    Swap,
    Update,
    Want,
    counters_ok,
    decide,
)
from procman.policy import RestartPolicy
from procman.table import NOW, POLICY, ROWS

S = State
WALKS = 1000
STEPS = 60


def reached(state: State, event: Event, c: Counters, policy: Policy, now: float) -> list[tuple[State, Counters]]:
    """Every (state, counters) ``event`` leads through, follow-ups included, the way Backend._apply takes them."""
    d = decide(state, event, c, policy, now)
    seen = [(d.state, d.counters)]
    state, c = d.state, d.counters
    for effect in d.effects:
        if isinstance(effect, FollowUp):
            more = reached(state, effect.event, c, policy, now)
            seen += more
            state, c = more[-1]
    return seen


def events(state: State, c: Counters) -> list[Event]:
    """What a backend in ``state`` can be told: any command or timer, and the helpers' reports it can get."""
    g = c.generation
    choices: list[Event] = [
        Want(True), Want(False), Stop("unload"), Stop("stop", drain=False), Close(True), Close(False),
        Restart("manual"), Restart("fatal", g), Restart("hang", g), Restart("fatal", g - 1), Update(), Retune(),
        Exited(g), Exited(g, "fatal"), Exited(g, blamed=True), Exited(g, lost=True), Exited(g - 1), Hung(g),
        Hung(g, blamed=True), Hung(g, outside=True), Restart("hang", g, outside=True), RetryDue(), IdleTick(),
        DrainTimeout(), Forgive((g,), 1), KeepAlive(0.0),
        KeepAlive(float("inf")), KeepAlive(None),
    ]
    if c.in_flight:  # a done is for a counted request
        choices += [Done()] * 3
    if state is S.STARTING:  # the start under way ends; aborted only when it was interrupted
        ends = [Started("ok"), Started("failed"), Started("refused")]
        if c.abort is not None:
            ends += [Started("aborted"), Started("aborted", has_process=True)]
        choices += ends * 2
    if state is S.STOPPING:  # the process a Terminate was for is gone
        choices += [Reaped()] * 4
    return choices


def check(state: State, c: Counters, why: str) -> None:
    problem = counters_ok(state, c)
    assert problem is None, f"{why}: {problem}\n  {state.name} {c}"


def test_flags_name_fields_of_counters() -> None:
    assert set(FLAGS) <= set(Counters._fields)
    assert set(FLAGS) == {"then", "draining", "wanted", "auto", "abort", "swap", "closed", "died"}


@pytest.mark.parametrize(("situation", "state", "counters", "event"), ROWS, ids=[r[0] for r in ROWS])
def test_every_row_of_the_table_stays_within_the_allowed_counters(
    situation: str, state: State, counters: Counters, event: Event
) -> None:
    check(state, counters, f"the row {situation!r} starts")
    for new, c in reached(state, event, counters, POLICY, NOW):
        check(new, c, f"the row {situation!r} leads")


def test_random_walks_stay_within_the_allowed_counters() -> None:
    for seed in range(WALKS):
        rng = random.Random(seed)
        _, state, c, _ = rng.choice(ROWS)
        restart = RestartPolicy(max_retries=rng.choice([0, 2, 5]))
        policy = Policy(restart=restart, idle_timeout_s=rng.choice([0.0, 60.0]))
        now, trail = NOW, []
        for _ in range(STEPS):
            now += rng.choice([0.0, 0.5, 3.0, 30.0])
            event = rng.choice(events(state, c))
            trail.append(f"{state.name} {event}")
            path = reached(state, event, c, policy, now)
            for new, counters in path:
                check(new, counters, f"seed {seed}, after " + " / ".join(trail[-4:]))
            state, c = path[-1]


def test_counters_ok_names_what_is_wrong() -> None:
    assert counters_ok(S.STOPPED, Counters(swap=True)) == "swap=True in STOPPED"
    assert counters_ok(S.READY, Counters(draining=True)) == "READY draining with nothing in flight"
    assert counters_ok(S.STARTING, Counters(swap=True)) == "STARTING with a new spec waiting and no interruption"
    assert counters_ok(S.READY, Counters(in_flight=2, draining=True, then="start", swap=True, wanted=True)) is None


# -- the edges that used to leave a flag behind ----------------------------------------------------------


def row(state: State, event: Event, c: Counters) -> Decision:
    return decide(state, event, c, Policy(), NOW)


def test_starting_to_backoff_a_start_that_fails_after_a_reload_and_a_stop_takes_the_new_spec() -> None:
    c = row(S.STARTING, Update(), Counters(generation=1)).counters  # the reload interrupts the start...
    c = row(S.STARTING, Stop("unload"), c).counters  # ...and a stop after it
    state, c, effects = row(S.STARTING, Started("failed"), c)
    assert state is S.BACKOFF and Swap() in effects and FollowUp(Stop("unload", drain=False)) in effects
    assert not c.swap  # it was STOPPED with the old spec and swap set: the next start ran the old spec


def test_ready_to_backoff_a_crash_during_a_reload_drain_relaunches_the_new_spec_with_no_swap_left() -> None:
    c = row(S.READY, Update(), Counters(generation=1, in_flight=1)).counters
    assert c.swap and c.draining
    state, c = reached(S.READY, Exited(1), c, Policy(), NOW)[-1]
    assert state is S.STARTING and not c.swap
    state, c, _ = row(S.STARTING, Started("ok"), c)
    assert state is S.READY and counters_ok(state, c) is None  # READY with swap set: a later retune restarted it


def test_backoff_to_stopped_tells_callers_parked_on_the_relaunch() -> None:
    c = Counters(generation=1, failures=1, backoff_until=NOW + 2, auto=True, died=True, wanted=True)
    state, c, effects = row(S.BACKOFF, Stop("unload"), c)
    assert state is S.STOPPED and FailParked("interrupted", by="unload") in effects and not c.wanted


async def test_a_retune_after_a_crash_during_a_reload_keeps_the_process(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    backend = h.add()
    try:
        async with backend.request():
            update = asyncio.ensure_future(backend.update(dataclasses.replace(backend.spec, env={"V": "2"})))
            await h.clock.advance(0.1)
            h.spawner.last.exit(1)  # crashes while the reload drains
            await h.clock.run(update)
        await h.clock.run(backend.ensure_ready())
        pid, spec = backend.pid, backend.spec
        assert spec.env["V"] == "2" and not backend.counters.swap
        await h.clock.run(backend.update(dataclasses.replace(spec, idle_timeout_s=99.0)))
        assert backend.pid == pid and backend.spec.idle_timeout_s == 99.0  # retuned, not restarted
    finally:
        await h.close()


