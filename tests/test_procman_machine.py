"""``decide`` as a table: one row per edge of the state machine, no asyncio, no processes.

Each row is (state, counters, event) -> (state, some of the counters, the effects). The
Backend's tests (test_procman_backend.py, test_procman_states.py) check that the owner
task carries the effects out; these check the decisions alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from procman import RestartPolicy, State
from procman.machine import (
    Abort,
    Admit,
    Arm,
    Blame,
    Close,
    Counters,
    Disarm,
    Done,
    DrainTimeout,
    Exited,
    FailParked,
    FollowUp,
    Forgive,
    GiveUp,
    Hung,
    IdleTick,
    KeepAlive,
    Notify,
    Park,
    Policy,
    Reap,
    Reaped,
    Refuse,
    Restart,
    RetryDue,
    Retune,
    Spawn,
    Started,
    Stop,
    Swap,
    Terminate,
    Update,
    Wake,
    Want,
    Watch,
    decide,
    failures_now,
    idle_after_s,
)
from procman.states import ALLOWED

S = State
NOW = 1000.0
P = Policy(restart=RestartPolicy(max_retries=3, backoff_base_s=1.0, backoff_max_s=8.0, stable_after_s=30.0),
           idle_timeout_s=60.0, drain_timeout_s=300.0)
C = Counters(generation=1, ready_at=900.0, idle_since=950.0)


def row(
    state: State, event: Any, counters: Counters = C, policy: Policy = P
) -> tuple[State, Counters, tuple[Any, ...]]:
    new, counters_after, effects = decide(state, event, counters, policy, NOW)
    assert new is state or new in ALLOWED[state], f"{state.name}->{new.name} is not in ALLOWED"
    return new, counters_after, effects


# -- STOPPED -------------------------------------------------------------------------------------


def test_stopped_to_starting_on_want() -> None:
    state, c, effects = row(S.STOPPED, Want(count=True))
    assert state is S.STARTING and c.reason == "cold" and c.wanted and not c.auto
    assert effects == (Park(), Disarm("retry"), Spawn("cold", reserve=True))


def test_stopped_to_starting_on_manual_restart_is_a_relaunch_nobody_waits_for() -> None:
    state, c, effects = row(S.STOPPED, Restart("manual"))
    assert state is S.STARTING and c.auto and Spawn("manual", reserve=True) in effects


def test_stopped_stays_on_stop() -> None:
    assert row(S.STOPPED, Stop("unload")) == (S.STOPPED, C, ())


def test_stopped_update_swaps_the_spec_and_clears_failures() -> None:
    state, c, effects = row(S.STOPPED, Update(), C._replace(failures=2, backoff_until=NOW + 5))
    assert state is S.STOPPED and effects == (Swap(),) and c.failures == 0 and c.backoff_until is None


def test_closed_refuses_every_want() -> None:
    assert row(S.STOPPED, Want(), C._replace(closed=True))[2] == (Refuse("closed"),)


# -- STARTING ------------------------------------------------------------------------------------


def test_starting_parks_another_want() -> None:
    state, c, effects = row(S.STARTING, Want())
    assert state is S.STARTING and effects == (Park(),)


def test_starting_to_ready_when_the_start_succeeds() -> None:
    state, c, effects = row(S.STARTING, Started("ok"), C._replace(reason="cold", ready_at=None))
    assert state is S.READY and c.generation == 2 and c.ready_at == NOW and c.idle_since == NOW
    assert effects == (Notify("start", "cold"), Watch(), Arm("idle", 60.0), Wake())


def test_starting_to_ready_without_idle_timer_when_idle_timeout_is_zero() -> None:
    _, _, effects = row(S.STARTING, Started("ok"), policy=replace(P, idle_timeout_s=0.0))
    assert Disarm("idle") in effects and not any(isinstance(e, Arm) for e in effects)


def test_starting_to_backoff_when_a_cold_start_fails_no_background_retry() -> None:
    state, c, effects = row(S.STARTING, Started("failed"), C._replace(reason="cold", failures=1))
    assert state is S.BACKOFF and c.failures == 2 and c.backoff_until == NOW + 1.0
    assert effects == (Notify("start", "cold", ok=False), Blame("start"), FailParked("failed", retry_after_s=1.0))


def test_starting_to_backoff_when_a_relaunch_fails_arms_the_retry() -> None:
    state, c, effects = row(S.STARTING, Started("failed"), C._replace(reason="crash", failures=2, auto=True))
    assert state is S.BACKOFF and c.failures == 3 and effects[-1] == Arm("retry", 2.0)


def test_starting_to_backoff_gives_up_after_max_retries() -> None:
    _, c, effects = row(S.STARTING, Started("failed"), C._replace(failures=3, auto=True))
    assert c.failures == 4 and effects[-1] == GiveUp()


def test_starting_to_stopped_when_refused_for_room() -> None:
    state, c, effects = row(S.STARTING, Started("refused"), C._replace(failures=0))
    assert state is S.STOPPED and effects == (FailParked("failed"),) and c.failures == 0


def test_starting_to_backoff_when_refused_for_room_after_failures() -> None:
    state, c, _ = row(S.STARTING, Started("refused"), C._replace(failures=2))
    assert state is S.BACKOFF and c.failures == 2  # a refusal is no failure


def test_stop_during_a_start_aborts_it_and_fails_the_waiters() -> None:
    state, c, effects = row(S.STARTING, Stop("unload"))
    assert state is S.STARTING and c.abort == "unload" and c.then == "stop"
    assert effects == (Abort("unload"), FailParked("interrupted", by="unload"))


def test_starting_to_stopping_when_the_aborted_start_left_a_process() -> None:
    state, c, effects = row(S.STARTING, Started("aborted", has_process=True), C._replace(abort="unload"))
    assert state is S.STOPPING and c.then == "stop" and effects == (Terminate(),)


def test_starting_to_stopping_when_the_start_won_the_race_with_its_abort() -> None:
    state, c, effects = row(S.STARTING, Started("ok"), C._replace(abort="unload"))
    assert state is S.STOPPING and effects == (Terminate(),)


def test_starting_to_stopped_when_aborted_before_the_spawn() -> None:
    state, _, effects = row(S.STARTING, Started("aborted"), C._replace(abort="unload", reason="unload"))
    assert state is S.STOPPED and effects == (Notify("stop", "unload"),)


def test_reload_during_a_start_keeps_the_waiters() -> None:
    state, c, effects = row(S.STARTING, Update())
    assert state is S.STARTING and c.swap and c.abort == "reload" and effects == (Abort("reload"),)


def test_reload_abort_before_the_spawn_starts_the_new_spec() -> None:
    state, c, effects = row(S.STARTING, Started("aborted"), C._replace(abort="reload", swap=True))
    assert state is S.STARTING and not c.swap and effects == (Swap(), Spawn("reload", reserve=True))


# -- READY ---------------------------------------------------------------------------------------


def test_ready_admits_and_counts() -> None:
    state, c, effects = row(S.READY, Want(count=True))
    assert state is S.READY and c.in_flight == 1 and effects == (Admit(),)


def test_ready_admits_without_counting_for_ensure_ready() -> None:
    assert row(S.READY, Want())[1].in_flight == 0


def test_ready_to_stopping_on_stop_with_nothing_in_flight() -> None:
    state, c, effects = row(S.READY, Stop("unload"))
    assert state is S.STOPPING and c.then == "stop" and effects == (Disarm("drain"), Terminate())


def test_ready_drains_before_stopping() -> None:
    state, c, effects = row(S.READY, Stop("unload"), C._replace(in_flight=2))
    assert state is S.READY and c.draining and effects == (Arm("drain", 300.0), Disarm("idle"))


def test_draining_parks_new_callers() -> None:
    state, c, effects = row(S.READY, Want(count=True), C._replace(in_flight=1, draining=True))
    assert effects == (Park(),) and c.wanted and c.in_flight == 1


def test_ready_to_stopping_when_the_last_drained_request_ends() -> None:
    state, c, effects = row(S.READY, Done(), C._replace(in_flight=1, draining=True))
    assert state is S.STOPPING and c.in_flight == 0 and effects == (Disarm("drain"), Terminate())


def test_ready_to_stopping_when_the_drain_times_out() -> None:
    state, _, effects = row(S.READY, DrainTimeout(), C._replace(in_flight=1, draining=True))
    assert state is S.STOPPING and effects == (Terminate(),)


def test_stop_without_drain_kills_with_requests_in_flight() -> None:
    assert row(S.READY, Stop("shutdown", drain=False), C._replace(in_flight=3))[0] is S.STOPPING


def test_last_request_done_arms_the_idle_timer() -> None:
    state, c, effects = row(S.READY, Done(), C._replace(in_flight=1))
    assert c.in_flight == 0 and c.idle_since == NOW and effects == (Arm("idle", 60.0),)


def test_idle_tick_too_early_rearms() -> None:
    assert row(S.READY, IdleTick())[2] == (Arm("idle", 10.0),)  # idle since 950, timeout 60, now 1000


def test_ready_to_stopping_when_idle() -> None:
    state, c, effects = row(S.READY, IdleTick(), C._replace(idle_since=NOW - 60.0))
    assert state is S.STOPPING and c.reason == "idle" and effects == (Terminate(),)


def test_idle_tick_ignored_while_a_request_is_in_flight() -> None:
    assert row(S.READY, IdleTick(), C._replace(idle_since=0.0, in_flight=1)) == (
        S.READY, C._replace(idle_since=0.0, in_flight=1), ())


def test_ready_to_backoff_on_a_crash_relaunches_at_once() -> None:
    state, c, effects = row(S.READY, Exited(generation=1))
    assert state is S.BACKOFF and c.failures == 1 and c.backoff_until == NOW and c.auto
    assert effects[:3] == (Notify("restart", "crash"), Blame("crash"), Reap())
    assert effects[-1] == FollowUp(RetryDue())


def test_second_crash_waits_out_the_backoff() -> None:
    _, c, effects = row(S.READY, Exited(generation=1), C._replace(failures=1, ready_at=NOW - 1))
    assert c.failures == 2 and effects[-1] == Arm("retry", 1.0)


def test_crash_after_stable_uptime_counts_as_a_first_failure() -> None:
    _, c, effects = row(S.READY, Exited(generation=1), C._replace(failures=3, ready_at=NOW - 30.0))
    assert c.failures == 1 and effects[-1] == FollowUp(RetryDue())


def test_exit_of_an_old_generation_is_ignored() -> None:
    assert row(S.READY, Exited(generation=0)) == (S.READY, C, ())


def test_crash_while_draining_for_a_stop_still_stops() -> None:
    state, _, effects = row(S.READY, Exited(generation=1), C._replace(in_flight=1, draining=True, reason="unload"))
    assert state is S.BACKOFF and effects[-1] == FollowUp(Stop("unload", drain=False))


def test_ready_to_stopping_on_hang_kills_at_once() -> None:
    state, c, effects = row(S.READY, Hung(generation=1))
    assert state is S.STOPPING and c.then == "fail" and c.failures == 1
    assert effects[0] == Notify("restart", "hang") and effects[-1] == Terminate(graceful=False)


def test_ready_to_stopping_on_fatal_kills_at_once() -> None:
    state, c, effects = row(S.READY, Restart("fatal", generation=1))
    assert state is S.STOPPING and c.then == "fail" and effects[-1] == Terminate(graceful=False)


def test_fatal_for_an_old_generation_is_a_no_op() -> None:
    assert row(S.READY, Restart("fatal", generation=0)) == (S.READY, C, ())


def test_ready_to_stopping_on_manual_restart_is_graceful_and_no_failure() -> None:
    state, c, effects = row(S.READY, Restart("manual"))
    assert state is S.STOPPING and c.then == "start" and c.failures == 0
    assert effects == (Notify("restart", "manual"), Disarm("drain"), Terminate())


def test_update_of_a_ready_backend_drains_then_restarts() -> None:
    state, c, effects = row(S.READY, Update(), C._replace(in_flight=1))
    assert state is S.READY and c.draining and c.swap and c.then == "start"
    assert Arm("drain", 300.0) in effects


def test_update_of_an_idle_ready_backend_stops_at_once() -> None:
    state, c, _ = row(S.READY, Update())
    assert state is S.STOPPING and c.swap and c.then == "start"


def test_retune_rewatches_and_rearms_the_idle_timer() -> None:
    _, c, effects = row(S.READY, Retune(), policy=replace(P, idle_timeout_s=120.0))
    assert c == C and effects == (Watch(), Arm("idle", 70.0))


# -- STOPPING ------------------------------------------------------------------------------------


def test_stopping_to_stopped_when_reaped() -> None:
    state, c, effects = row(S.STOPPING, Reaped(), C._replace(then="stop", reason="unload"))
    assert state is S.STOPPED and effects == (Notify("stop", "unload"),)


def test_stopping_to_stopped_then_a_fresh_start_for_parked_callers() -> None:
    _, c, effects = row(S.STOPPING, Reaped(), C._replace(then="stop", reason="evict", wanted=True))
    assert effects == (Notify("stop", "evict"), FollowUp(Want())) and not c.wanted


def test_stopping_parks_a_want_and_starts_again_after() -> None:
    state, c, effects = row(S.STOPPING, Want())
    assert effects == (Park(),) and c.wanted


def test_stopping_to_starting_after_a_manual_restart_keeps_its_room() -> None:
    state, c, effects = row(S.STOPPING, Reaped(), C._replace(then="start", reason="manual"))
    assert state is S.STARTING and effects == (Spawn("manual", reserve=False),)


def test_stopping_to_starting_after_a_reload_swaps_first() -> None:
    state, c, effects = row(S.STOPPING, Reaped(), C._replace(then="start", reason="reload", swap=True, failures=2))
    assert state is S.STARTING and effects == (Swap(), Spawn("reload", reserve=False)) and c.failures == 0


def test_stopping_to_backoff_after_a_kill_relaunches() -> None:
    state, c, effects = row(S.STOPPING, Reaped(), C._replace(then="fail", reason="hang", failures=1))
    assert state is S.BACKOFF and c.backoff_until == NOW and effects == (FollowUp(RetryDue()),)


def test_stopping_to_backoff_keeps_parked_callers_for_a_relaunch_due_soon() -> None:
    _, c, effects = row(S.STOPPING, Reaped(), C._replace(then="fail", reason="fatal", failures=2, wanted=True))
    assert effects == (Arm("retry", 1.0),) and c.wanted  # they get the fresh process a second later


def test_stopping_to_backoff_tells_parked_callers_to_come_back_after_a_long_delay() -> None:
    slow = replace(P, restart=replace(P.restart, backoff_base_s=20.0, backoff_max_s=60.0))
    _, c, effects = decide(S.STOPPING, Reaped(), C._replace(then="fail", reason="fatal", failures=2, wanted=True),
                           slow, NOW)
    assert effects == (FailParked("backoff", retry_after_s=20.0), Arm("retry", 20.0)) and not c.wanted


def test_ready_to_backoff_on_a_poison_crash_counts_no_failure_and_relaunches_at_once() -> None:
    state, c, effects = row(S.READY, Exited(generation=1, blamed=True), C._replace(failures=2, ready_at=NOW - 1))
    assert state is S.BACKOFF and c.failures == 2 and effects[-1] == Arm("retry", 1.0)  # the delay of 2, not 3
    state, c, effects = row(S.READY, Exited(generation=1, blamed=True), C._replace(in_flight=1))
    assert c.failures == 0 and effects[-1] == FollowUp(RetryDue())


def test_ready_to_backoff_on_a_lost_node_counts_no_failure_and_relaunches_at_once() -> None:
    state, c, effects = row(S.READY, Exited(generation=1, lost=True), C._replace(ready_at=NOW - 1))
    assert state is S.BACKOFF and c.failures == 0 and effects[-1] == FollowUp(RetryDue())
    _, c, _ = row(S.READY, Exited(generation=1, lost=True), C._replace(failures=1, ready_at=NOW - 1))
    assert c.failures == 1  # counted failures stay as they were


def test_ready_to_backoff_on_a_fatal_exit_is_reported_as_fatal() -> None:
    _, c, effects = row(S.READY, Exited(generation=1, cause="fatal"))
    assert c.reason == "fatal" and Notify("restart", "fatal") in effects and Blame("fatal") in effects


def test_ready_to_stopping_on_a_hang_one_request_caused_counts_no_failure() -> None:
    state, c, effects = row(S.READY, Hung(generation=1, blamed=True), C._replace(in_flight=1))
    assert state is S.STOPPING and c.failures == 0 and Terminate(graceful=False) in effects


@pytest.mark.parametrize("event", [Hung(generation=1, outside=True), Restart("hang", 1, outside=True)])
def test_ready_to_stopping_on_a_hang_from_outside_counts_no_failure(event: Any) -> None:
    """A process found stopped by a signal (SIGSTOP) did not fail: killed and relaunched at once, never toward
    the backoff, with one request in flight or several."""
    for in_flight in (0, 1, 3):
        state, c, effects = row(S.READY, event, C._replace(in_flight=in_flight, failures=2, ready_at=NOW - 1))
        assert state is S.STOPPING and c.failures == 2 and Terminate(graceful=False) in effects


def test_want_in_backoff_waits_for_a_relaunch_due_soon() -> None:
    relaunching = C._replace(auto=True, died=True, failures=2, backoff_until=NOW + 2.0)
    state, c, effects = row(S.BACKOFF, Want(count=True), relaunching)
    assert state is S.BACKOFF and effects == (Park(),) and c.wanted


def test_want_in_backoff_is_refused_when_the_relaunch_is_far_or_a_cold_start_failed() -> None:
    far = C._replace(auto=True, died=True, failures=2, backoff_until=NOW + 30.0)
    assert row(S.BACKOFF, Want(count=True), far)[2] == (Refuse("backoff", 30.0),)
    cold = C._replace(auto=False, failures=1, backoff_until=NOW + 2.0)
    assert row(S.BACKOFF, Want(count=True), cold)[2] == (Refuse("backoff", 2.0),)
    gave_up = C._replace(auto=True, died=True, failures=4, backoff_until=NOW + 2.0)
    assert row(S.BACKOFF, Want(count=True), gave_up)[2] == (Refuse("backoff", 2.0),)
    relaunch_failed = C._replace(auto=True, died=False, failures=2, backoff_until=NOW + 2.0)
    assert row(S.BACKOFF, Want(count=True), relaunch_failed)[2] == (Refuse("backoff", 2.0),)


def test_stop_while_stopping_for_a_restart_ends_stopped() -> None:
    _, c, _ = row(S.STOPPING, Stop("unload"), C._replace(then="start"))
    assert c.then == "stop" and c.reason == "unload"


def test_a_hung_process_draining_after_a_close_is_killed_at_once_and_ends_stopped() -> None:
    state, c, effects = row(S.READY, Hung(C.generation), C._replace(closed=True, draining=True, then="stop",
                                                                       in_flight=2))
    assert state is S.STOPPING and effects[-1] == Terminate(graceful=False) and c.then == "stop"
    assert row(S.STOPPING, Reaped(), c)[0] is S.STOPPED
    assert row(S.READY, Restart("manual"), C._replace(closed=True, draining=True))[0] is S.READY


def test_closed_backend_is_not_restarted_after_reaping() -> None:
    state, _, _ = row(S.STOPPING, Reaped(), C._replace(then="start", closed=True))
    assert state is S.STOPPED


# -- BACKOFF -------------------------------------------------------------------------------------


def test_backoff_refuses_until_the_delay_is_over() -> None:
    _, _, effects = row(S.BACKOFF, Want(), C._replace(failures=2, backoff_until=NOW + 1.5))
    assert effects == (Refuse("backoff", 1.5),)


def test_backoff_to_starting_on_want_once_the_delay_is_over() -> None:
    state, c, effects = row(S.BACKOFF, Want(), C._replace(failures=2, backoff_until=NOW))
    assert state is S.STARTING and Spawn("cold", reserve=True) in effects and not c.auto


def test_backoff_to_starting_when_the_retry_timer_fires() -> None:
    state, c, effects = row(S.BACKOFF, RetryDue(), C._replace(failures=2, backoff_until=NOW, auto=True, reason="crash"))
    assert state is S.STARTING and c.auto and effects == (Disarm("retry"), Spawn("crash", reserve=True))


def test_retry_timer_of_a_cold_failure_does_nothing() -> None:
    assert row(S.BACKOFF, RetryDue(), C._replace(backoff_until=NOW, auto=False))[0] is S.BACKOFF


def test_backoff_to_stopped_on_stop_cancels_the_retry() -> None:
    state, c, effects = row(S.BACKOFF, Stop("unload"), C._replace(auto=True))
    assert state is S.STOPPED and not c.auto and effects == (Disarm("retry"), Notify("stop", "unload"))


def test_backoff_update_while_relaunching_starts_the_new_spec() -> None:
    state, c, effects = row(S.BACKOFF, Update(), C._replace(failures=2, auto=True, backoff_until=NOW + 9))
    assert state is S.STARTING and c.failures == 0 and effects[0] == Swap() and Spawn("reload") in effects


def test_backoff_update_after_a_cold_failure_stays_stopped() -> None:
    state, c, effects = row(S.BACKOFF, Update(), C._replace(failures=2, auto=False))
    assert state is S.STOPPED and c.failures == 0 and Swap() in effects


def test_close_fails_parked_callers() -> None:
    state, c, effects = row(S.READY, Close(drain=True), C._replace(in_flight=1))
    assert c.closed and c.draining and effects[-1] == FailParked("closed")


# -- queries -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("state", "ready_for_s", "expected"), [
    (S.READY, 29.9, 2), (S.READY, 30.0, 0), (S.BACKOFF, 300.0, 2),
])
def test_failures_are_forgotten_after_stable_uptime(state: State, ready_for_s: float, expected: int) -> None:
    assert failures_now(state, C._replace(failures=2, ready_at=NOW - ready_for_s), P, NOW) == expected


def test_procman_readme_carries_the_state_table_decide_computes() -> None:
    from pathlib import Path

    from procman.table import BEGIN, END, markdown

    readme = (Path(__file__).resolve().parent.parent / "procman" / "README.md").read_text()
    shown = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    assert shown == markdown(), "procman/README.md's state table is stale: paste `python -m procman.table`"


def test_the_state_table_names_a_field_that_follows_a_default_one() -> None:
    from procman.events import Hung
    from procman.table import _words

    assert _words(Hung(1)) == "Hung(1)"
    assert _words(Hung(1, blamed=True)) == "Hung(1, True)"
    assert _words(Hung(1, outside=True)) == "Hung(1, outside=True)"  # not Hung(1, True): that reads as blamed
    assert _words(Hung(1, True, True)) == "Hung(1, True, True)"


def test_forgiven_deaths_leave_the_count_and_bring_the_relaunch_sooner() -> None:
    waiting = C._replace(auto=True, died=True, failures=3, backoff_until=NOW + 2.0)
    state, c, effects = row(S.BACKOFF, Forgive((4, 5), 2), waiting)
    assert state is S.BACKOFF and c.failures == 1 and c.backoff_until == NOW and effects == (FollowUp(RetryDue()),)
    _, c, effects = row(S.BACKOFF, Forgive((5,), 1), waiting)
    assert c.failures == 2 and c.backoff_until == NOW + 1.0 and effects == (Arm("retry", 1.0),)


def test_forgive_in_ready_lowers_the_count_only() -> None:
    state, c, effects = row(S.READY, Forgive((1, 2, 3), 3), C._replace(failures=2))
    assert state is S.READY and c.failures == 0 and effects == ()


# -- a client's keep-alive (Ollama's keep_alive) --------------------------------------------------

INF = float("inf")


@pytest.mark.parametrize(("keep_s", "idle_s", "after"), [
    (None, 60.0, 60.0), (None, 0.0, None), (0.0, 60.0, 0.0), (0.0, 0.0, 0.0), (300.0, 60.0, 300.0),
    (30.0, 60.0, 60.0), (300.0, 0.0, None), (INF, 60.0, None),
])
def test_idle_after_is_the_keep_alive_or_the_idle_timeout(keep_s: float | None, idle_s: float,
                                                         after: float | None) -> None:
    assert idle_after_s(C._replace(keep_s=keep_s), replace(P, idle_timeout_s=idle_s)) == after


def test_keep_alive_zero_on_an_idle_ready_backend_arms_the_idle_stop_now() -> None:
    state, c, effects = row(S.READY, KeepAlive(0.0))
    assert state is S.READY and c.keep_s == 0.0 and effects == (Arm("idle", 0.0),)
    assert row(S.READY, IdleTick(), c)[0] is S.STOPPING


def test_keep_alive_with_requests_in_flight_waits_for_the_last_done() -> None:
    _, c, effects = row(S.READY, KeepAlive(0.0), C._replace(in_flight=1))
    assert effects == () and c.keep_s == 0.0
    assert row(S.READY, Done(), c)[2] == (Arm("idle", 0.0),)


def test_keep_alive_forever_disarms_the_idle_stop_and_a_tick_is_ignored() -> None:
    _, c, effects = row(S.READY, KeepAlive(INF))
    assert effects == (Disarm("idle"),)
    assert row(S.READY, IdleTick(), c._replace(idle_since=0.0))[2] == ()


def test_keep_alive_longer_than_the_idle_timeout_rearms_for_the_rest_of_it() -> None:
    assert row(S.READY, KeepAlive(100.0))[2] == (Arm("idle", 50.0),)  # idle since 950, now 1000


def test_keep_alive_while_stopped_is_remembered_for_the_start() -> None:
    _, c, effects = row(S.STOPPED, KeepAlive(INF))
    assert effects == () and c.keep_s == INF
    assert row(S.STARTING, Started("ok"), c)[2] == (Notify("start", ""), Watch(), Disarm("idle"), Wake())


@pytest.mark.parametrize("event", [Stop("unload"), Update(), Retune()])
def test_a_stop_or_a_changed_spec_ends_the_keep_alive(event: Any) -> None:
    assert row(S.READY, event, C._replace(keep_s=INF))[1].keep_s is None


def test_the_stop_of_the_process_ends_the_keep_alive() -> None:
    stopping = C._replace(keep_s=300.0, then="stop", reason="idle")
    state, c, _ = row(S.STOPPING, Reaped(), stopping)
    assert state is S.STOPPED and c.keep_s is None
