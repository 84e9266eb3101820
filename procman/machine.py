"""The decisions of one supervised backend, as one pure function (events and effects: procman/events.py).

``decide(state, event, counters, policy, now) -> Decision(state, counters, effects)`` says
what a backend does when something happens: a caller wants a ready process, a stop, a
restart or a reload is asked for, a start ends, the process exits or stops answering, a
timer fires. It does no I/O, awaits nothing and reads no clock (``now`` is an argument),
so every edge is tested as a row of a table. :class:`procman.backend.Backend` feeds it
events from one owner task and carries out the effects (spawn, terminate, kill, timers,
answers to callers, listener calls).

Failure counting, the stability reset and the backoff live here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from procman.events import (
    Abort,
    Admit,
    Arm,
    Blame,
    Close,
    Disarm,
    Done,
    DrainTimeout,
    Effect,
    Event,
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
    Switched,
    Terminate,
    Update,
    Wake,
    Want,
    Watch,
)
from procman.policy import RestartPolicy, backoff_delay
from procman.states import State

__all__ = [
    "DEFAULT_POLICY",
    "FAILURE_REASONS",
    "FLAGS",
    "Abort",
    "Admit",
    "Arm",
    "Blame",
    "Close",
    "Counters",
    "Decision",
    "Disarm",
    "Done",
    "DrainTimeout",
    "Effect",
    "Event",
    "Exited",
    "FailParked",
    "FollowUp",
    "Forgive",
    "GiveUp",
    "Hung",
    "IdleTick",
    "KeepAlive",
    "Notify",
    "Park",
    "Policy",
    "Reap",
    "Reaped",
    "Refuse",
    "Restart",
    "RetryDue",
    "Retune",
    "Spawn",
    "Started",
    "Stop",
    "Swap",
    "Switched",
    "Terminate",
    "Update",
    "Wake",
    "Want",
    "Watch",
    "answered",
    "counters_ok",
    "decide",
    "failures_now",
    "idle_after_s",
    "plain",
    "settled",
]

#: A request that finds its model relaunching after a run-time failure waits for the fresh process
#: when the relaunch is due within this many seconds (instead of an instant 503).
WAIT_FOR_RELAUNCH_S = 10.0
#: Restart reasons that count as a failure of the backend (they feed the backoff).
FAILURE_REASONS = frozenset({"crash", "hang", "fatal"})

S = State
Then = Literal["stop", "start", "fail"]


@dataclass(frozen=True, slots=True)
class Policy:
    """The supervision settings ``decide`` reads (all of them can change without a restart)."""

    restart: RestartPolicy = field(default_factory=RestartPolicy)
    idle_timeout_s: float = 0.0  # 0 = never stop for idleness
    drain_timeout_s: float = 300.0


#: procman's one set of supervision defaults: :class:`procman.BackendSpec` takes its own from here. A backend
#: never stops for idleness unless asked; the router always passes a model's ``idle_timeout_s``, whose
#: default for users (900 s) lives in ``modelserver/spec.py`` with every other model setting.
DEFAULT_POLICY = Policy()


class Counters(NamedTuple):
    """Everything ``decide`` remembers between events besides the state.

    A NamedTuple rather than a frozen dataclass: ``_replace`` runs on every request (admit, done)
    and costs a fraction of ``dataclasses.replace``.
    """

    failures: int = 0  # consecutive; forgotten after stable_after_s READY (see failures_now)
    backoff_until: float | None = None  # no start before this clock time
    ready_at: float | None = None  # clock time the current process became READY
    idle_since: float = 0.0  # clock time of READY or of the end of the last request
    in_flight: int = 0  # requests admitted and not done
    generation: int = 0  # grows with every successful start; names the process
    then: Then = "stop"  # STOPPING leads to: STOPPED, a new start, or BACKOFF (a failure)
    reason: str = ""  # of the pending stop, of the start under way, of the last failure
    draining: bool = False  # READY, a stop/reload waits for the requests in flight
    wanted: bool = False  # callers are parked: start again once this stop is over
    auto: bool = False  # nobody waits on this (re)launch: a failure retries in the background
    abort: str | None = None  # STARTING: the start was interrupted (by: stop, reload, ...)
    swap: bool = False  # a new spec waits for the process to go
    closed: bool = False  # removed or shutting down: no start ever again
    died: bool = False  # the last failure was a running process's death (a relaunch is worth waiting for)
    keep_s: float | None = None  # a client's keep-alive (KeepAlive) until the process stops or the spec changes


class Decision(NamedTuple):
    state: State
    counters: Counters
    effects: tuple[Effect, ...]


#: The flags of :class:`Counters` and the states in which each may differ from its default (``then``: from
#: "stop"). Elsewhere it holds its default: ``decide()`` resets it on the way out. ``counters_ok`` checks this
#: and the combinations below; tests/test_procman_counters.py checks every (state, counters) that decide()
#: reaches from each row of the state table and on random walks.
FLAGS: dict[str, frozenset[State]] = {
    "then": frozenset({S.READY, S.STOPPING}),  # READY: a stop or reload waits for a drain
    "draining": frozenset({S.READY}),
    "wanted": frozenset({S.STARTING, S.READY, S.STOPPING, S.BACKOFF}),  # READY: parked behind a drain
    "auto": frozenset({S.STARTING, S.BACKOFF}),  # a relaunch nobody waits on (read when it fails, when retried)
    "abort": frozenset({S.STARTING}),
    "swap": frozenset({S.STARTING, S.READY, S.STOPPING}),  # a new spec waits for the process to go
    "closed": frozenset(State),  # once closed, closed for good
    "died": frozenset({S.STOPPING, S.BACKOFF}),  # STOPPING: a hung or fatal process being killed
}
_DEFAULTS = Counters()


def counters_ok(state: State, c: Counters) -> str | None:
    """None when ``c`` is a combination the machine allows in ``state``; else what is wrong (FLAGS, and):

    - READY and draining: requests are in flight (the last one's Done ends the drain);
    - READY and ``then`` not "stop", READY and ``swap``, READY and ``wanted``: only behind a drain;
    - STARTING and ``swap``: the start was interrupted (``abort``);
    - ``then`` "fail": the process died (a failure is a death).
    """
    for flag, states in FLAGS.items():
        if state not in states and getattr(c, flag) != getattr(_DEFAULTS, flag):
            return f"{flag}={getattr(c, flag)!r} in {state.name}"
    if state is S.READY and (c.draining and not c.in_flight):
        return "READY draining with nothing in flight"
    if state is S.READY and not c.draining and (c.then != "stop" or c.swap or c.wanted):
        return f"READY then={c.then!r} swap={c.swap} wanted={c.wanted} with no drain"
    if state is S.STARTING and c.swap and c.abort is None:
        return "STARTING with a new spec waiting and no interruption"
    if c.then == "fail" and not c.died:
        return "then='fail' and no death"
    return None


#: When the caller of an event hears back (``answered``): a Want by the decision's effects (Admit, Park,
#: Refuse), a command once the backend settles (``settled``), every other event once its turn came.
Answer = Literal["decision", "settled", "turn"]
_ANSWERS: dict[type, Answer] = {Want: "decision", Stop: "settled", Close: "settled", Restart: "settled",
                                Update: "settled", Retune: "settled"}
#: Settled states: a command (stop, restart, update) is answered once the backend rests in one, with no drain.
SETTLED = frozenset({State.STOPPED, State.READY, State.BACKOFF})


# -- queries ----------------------------------------------------------------------------------


def failures_now(state: State, counters: Counters, policy: Policy, now: float) -> int:
    """The failure count, forgotten once the process stayed READY for ``stable_after_s``."""
    c = counters
    if state is S.READY and c.ready_at is not None and now - c.ready_at >= policy.restart.stable_after_s:
        return 0
    return c.failures


def idle_after_s(counters: Counters, policy: Policy) -> float | None:
    """How long the READY process may stay idle before it is stopped; None: never.

    ``idle_timeout_s`` (0 = never), unless a client's keep-alive says otherwise: 0 stops it once idle,
    ``inf`` never, another value keeps it at least that long.
    """
    keep, idle = counters.keep_s, policy.idle_timeout_s
    if keep is None:
        return idle if idle > 0 else None
    if keep <= 0:
        return 0.0
    if keep == float("inf") or idle <= 0:
        return None
    return max(idle, keep)


def answered(event: Event) -> Answer:
    """When the caller of ``event`` is answered: by the decision, once the backend settles, or at once."""
    return _ANSWERS.get(type(event), "turn")


def settled(state: State, counters: Counters) -> bool:
    """Whether the commands waiting for the backend to settle are answered now."""
    return state in SETTLED and not counters.draining


def plain(event: Want | Done, decision: Decision) -> bool:
    """A request's admit or done whose answer touches nothing but the counters (``Backend._shortcut``): READY
    stays READY, and an admit is answered ``Admit()`` alone, a done (others still in flight) with nothing."""
    if decision.state is not State.READY:
        return False
    effects = decision.effects
    if type(event) is Want:
        return len(effects) == 1 and type(effects[0]) is Admit
    return not effects


def backoff_remaining(counters: Counters, now: float) -> float:
    if counters.backoff_until is None:
        return 0.0
    return max(0.0, counters.backoff_until - now)


# -- the decision -----------------------------------------------------------------------------


def decide(state: State, event: Event, counters: Counters, policy: Policy, now: float) -> Decision:
    """What ``event`` does to a backend in ``state``: the next state, counters and effects."""
    handler: Callable[[State, Any, Counters, Policy, float], Decision] = _HANDLERS[type(event)]
    return handler(state, event, counters, policy, now)


def _same(state: State, c: Counters, *effects: Effect) -> Decision:
    return Decision(state, c, effects)


def _cold_start(c: Counters, reason: str = "cold", *, auto: bool = False) -> Decision:
    # STOPPED -> STARTING, BACKOFF -> STARTING
    c = c._replace(reason=reason, auto=auto, abort=None, then="stop", died=False)
    return Decision(S.STARTING, c, (Disarm("retry"), Spawn(reason, reserve=True)))


def _resting(c: Counters) -> Counters:
    """The counters of a backend that comes to rest in STOPPED: no stop, start, wait or spec is pending."""
    return c._replace(then="stop", wanted=False, auto=False, abort=None, swap=False, died=False)


def _on_want(state: State, e: Want, c: Counters, p: Policy, now: float) -> Decision:
    if c.closed:
        return _same(state, c, Refuse("closed"))
    if state is S.READY and not c.draining:
        return _same(state, c._replace(in_flight=c.in_flight + e.count), Admit())
    if state in (S.STARTING, S.STOPPING, S.READY):  # a start under way, or a stop to wait out
        return _same(state, c._replace(wanted=True), Park())
    if state is S.BACKOFF and (remaining := backoff_remaining(c, now)) > 0:
        if _relaunching(c, p) and remaining <= WAIT_FOR_RELAUNCH_S:  # it died at run time: wait for the fresh one
            return _same(state, c._replace(wanted=True), Park())
        return _same(state, c, Refuse("backoff", remaining))
    cold = _cold_start(c._replace(wanted=True))
    return Decision(cold.state, cold.counters, (Park(), *cold.effects))


def _relaunching(c: Counters, p: Policy) -> bool:
    """BACKOFF with a relaunch of a process that ran (not a failed cold start) still to come."""
    return c.auto and c.died and not c.closed and c.failures <= p.restart.max_retries


def _on_done(state: State, e: Done, c: Counters, p: Policy, now: float) -> Decision:
    c = c._replace(in_flight=max(c.in_flight - 1, 0), idle_since=now)
    if c.in_flight or state is not S.READY:
        return _same(state, c)
    if c.draining:  # READY -> STOPPING: the last request of a drain ended
        return Decision(S.STOPPING, c._replace(draining=False), (Disarm("drain"), Terminate()))
    return _same(state, c, *_arm_idle(c, p, now))


def _arm_idle(c: Counters, p: Policy, now: float) -> tuple[Effect, ...]:
    """The idle timer for a READY process with nothing in flight, counted from ``idle_since``."""
    after = idle_after_s(c, p)
    return (Arm("idle", max(0.0, c.idle_since + after - now)),) if after is not None else (Disarm("idle"),)


def _stop(state: State, c: Counters, p: Policy, reason: str, drain: bool) -> Decision:
    c = c._replace(keep_s=None)  # asked to stop: a client's keep-alive no longer holds it
    if state is S.STOPPED:
        return _same(state, c)
    if state is S.BACKOFF:  # BACKOFF -> STOPPED: the pending relaunch is cancelled, and so are its waiters
        told = (FailParked("interrupted", by=reason),) if c.wanted and not c.closed else ()
        return Decision(S.STOPPED, _resting(c), (Disarm("retry"), *told, Notify("stop", reason)))
    if state is S.STARTING:  # the start ends with Started('aborted'): STARTING -> STOPPING -> STOPPED
        c = c._replace(abort=reason, then="stop", reason=reason, wanted=False, auto=False)
        return _same(state, c, Abort(reason), FailParked("interrupted", by=reason))
    if state is S.STOPPING:
        return _same(state, c._replace(then="stop", reason=reason))
    if drain and c.in_flight:  # READY, draining: Done or DrainTimeout moves on
        c = c._replace(draining=True, then="stop", reason=reason)
        return _same(state, c, Arm("drain", p.drain_timeout_s), Disarm("idle"))
    # READY -> STOPPING
    return Decision(S.STOPPING, c._replace(draining=False, then="stop", reason=reason), (Disarm("drain"), Terminate()))


def _on_stop(state: State, e: Stop, c: Counters, p: Policy, now: float) -> Decision:
    return _stop(state, c, p, e.reason, e.drain)


def _on_close(state: State, e: Close, c: Counters, p: Policy, now: float) -> Decision:
    d = _stop(state, c._replace(closed=True), p, "remove" if e.drain else "shutdown", e.drain)
    return Decision(d.state, d.counters, (*d.effects, FailParked("closed")))


def _on_restart(state: State, e: Restart, c: Counters, p: Policy, now: float) -> Decision:
    if c.closed and not (state is S.READY and e.reason in FAILURE_REASONS):
        return _same(state, c)  # closing: only a hung or failed process still draining is killed (below)
    if e.generation is not None and (e.generation != c.generation or state is not S.READY):
        return _same(state, c)  # that process is gone already: someone else restarted it
    if state is S.READY and e.reason in FAILURE_REASONS:
        return _fault(c, e.reason, p, now, counted=not e.blamed and not e.outside)
    if state is S.READY:  # READY -> STOPPING, then STOPPING -> STARTING: a replacement, no failure
        c = c._replace(then="start", reason=e.reason, draining=False)
        return Decision(S.STOPPING, c, (Notify("restart", e.reason), Disarm("drain"), Terminate()))
    if state in (S.STOPPED, S.BACKOFF):
        return _cold_start(c, e.reason, auto=True)
    if state is S.STOPPING and c.then == "stop":
        return _same(state, c._replace(then="start", reason=e.reason))
    return _same(state, c)  # STARTING: the start under way is the answer


def _fault(c: Counters, reason: str, p: Policy, now: float, counted: bool) -> Decision:
    """READY -> STOPPING: a hung or fatally failed process is SIGKILLed at once; BACKOFF follows (a failure,
    unless a poison request is to blame, or the hang was a stop from outside: neither is the model crash-looping,
    and backing off protects no start from them, so they are not ``counted``)."""
    failures = failures_now(S.READY, c, p, now) + counted
    intent = c.then if c.draining else "fail"
    c = c._replace(failures=failures, then="fail", reason=reason, ready_at=None, draining=False, died=True)
    effects: tuple[Effect, ...] = (Notify("restart", reason), Blame(reason), Disarm("drain"), Disarm("idle"))
    if intent == "stop":  # a stop was draining: it still ends in STOPPED
        c = c._replace(then="stop")
    return Decision(S.STOPPING, c, (*effects, Terminate(graceful=False)))


def _on_hung(state: State, e: Hung, c: Counters, p: Policy, now: float) -> Decision:
    return _on_restart(state, Restart("hang", e.generation, e.blamed, e.outside), c, p, now)


def _on_exited(state: State, e: Exited, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.READY or e.generation != c.generation:
        return _same(state, c)
    # READY -> BACKOFF: the process is gone already, nothing to stop; a poison request's doing, or a lost
    # node, is no failure
    failures = failures_now(state, c, p, now) + (not e.blamed and not e.lost)
    pending_stop, stop_reason, swap = c.draining and c.then == "stop", c.reason or "stop", c.swap
    c = c._replace(failures=failures, backoff_until=now + backoff_delay(failures, p.restart), reason=e.cause,
                ready_at=None, draining=False, then="stop", auto=not pending_stop, died=True, swap=False)
    effects = (Notify("restart", e.cause), Blame(e.cause), Reap(), Disarm("drain"), Disarm("idle"))
    if pending_stop:  # the stop it drained for (after a reload's drain: with the new spec)
        return Decision(S.BACKOFF, c, (*effects, *((Swap(),) if swap else ()), FollowUp(Stop(stop_reason, False))))
    if swap:  # the reload it drained for: the new spec starts now (Update in BACKOFF takes it)
        return Decision(S.BACKOFF, c, (*effects, FollowUp(Update())))
    return Decision(S.BACKOFF, c, (*effects, *_recover(c, p)))


def _recover(c: Counters, p: Policy) -> tuple[Effect, ...]:
    """In BACKOFF after a failure nobody waits on: relaunch now, later (a timer), or give up."""
    if c.failures > p.restart.max_retries:
        return (GiveUp(),)
    delay = backoff_delay(c.failures, p.restart)
    return (FollowUp(RetryDue()),) if delay <= 0 else (Arm("retry", delay),)


def _on_reaped(state: State, e: Reaped, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.STOPPING:
        return _same(state, c)
    c = c._replace(ready_at=None, draining=False)
    swap: tuple[Effect, ...] = ()
    if c.swap:
        swap = (Swap(),)
        c = c._replace(swap=False, failures=0, backoff_until=None, then="start" if c.then == "fail" else c.then)
    if c.then == "start" and not c.closed:  # STOPPING -> STARTING: keeps its room
        c = c._replace(auto=True, abort=None, then="stop", died=False)
        return Decision(S.STARTING, c, (*swap, Spawn(c.reason, reserve=False)))
    if c.then == "fail" and not c.closed:  # STOPPING -> BACKOFF
        c = c._replace(backoff_until=now + backoff_delay(c.failures, p.restart), auto=True, then="stop")
        recover = _recover(c, p)
        park = (FailParked("backoff", retry_after_s=backoff_remaining(c, now)),) if c.wanted and not (
            recover and isinstance(recover[0], FollowUp | Arm)
            and backoff_remaining(c, now) <= WAIT_FOR_RELAUNCH_S) else ()
        return Decision(S.BACKOFF, c._replace(wanted=c.wanted and not park), (*swap, *park, *recover))
    # STOPPING -> STOPPED: a client's keep-alive was for the process that stopped
    again: tuple[Effect, ...] = (FollowUp(Want()),) if c.wanted and not c.closed else ()
    c = _resting(c)._replace(keep_s=None)
    return Decision(S.STOPPED, c, (*swap, Notify("stop", c.reason), *again))


def _on_started(state: State, e: Started, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.STARTING:
        return _same(state, c)
    if e.outcome == "ok" and c.abort is None:  # STARTING -> READY
        c = c._replace(generation=c.generation + 1, ready_at=now, idle_since=now, wanted=False, then="stop",
                       auto=False, died=False)
        effects = (Notify("start", c.reason), Watch(), *_arm_idle(c, p, now), Wake())
        return Decision(S.READY, c, effects)
    if e.outcome == "stopped" and c.abort is None:  # STARTING -> STOPPING -> STARTING: stopped from outside
        # (as a READY process's Hung.outside: killed at once and started again, no failure counted; waiters stay)
        return Decision(S.STOPPING, c._replace(then="start"), (Notify("restart", "hang"), Terminate(False)))
    if e.outcome in ("ok", "stopped") or (e.outcome == "aborted" and e.has_process):  # STARTING -> STOPPING
        then: Then = "start" if c.abort == "reload" else "stop"
        c = c._replace(then=then, reason=c.abort or c.reason, abort=None, auto=False)
        return Decision(S.STOPPING, c, (Terminate(e.outcome != "stopped"),))
    if e.outcome == "aborted" or (e.outcome == "refused" and c.abort is not None):  # nothing was spawned
        return _aborted_early(c)  # (a start refused room as it was interrupted: the interruption wins)
    if e.outcome == "refused":  # STARTING -> STOPPED / BACKOFF: no room, nothing spawned, no failure counted
        if c.failures:
            return Decision(S.BACKOFF, c._replace(wanted=False, auto=False), (FailParked("failed"),))
        return Decision(S.STOPPED, _resting(c), (FailParked("failed"),))
    return _start_failed(c, p, now)


def _aborted_early(c: Counters) -> Decision:
    if c.abort == "reload" and not c.closed:  # a reload's start of the new spec; stays STARTING
        c = c._replace(swap=False, failures=0, backoff_until=None, abort=None, reason="reload", auto=True)
        return Decision(S.STARTING, c, (Swap(), Spawn("reload", reserve=True)))
    swap: tuple[Effect, ...] = (Swap(),) if c.swap else ()  # STARTING -> STOPPED
    return Decision(S.STOPPED, _resting(c), (*swap, Notify("stop", c.reason)))


def _start_failed(c: Counters, p: Policy, now: float) -> Decision:
    # STARTING -> BACKOFF: a failure; a relaunch nobody waited on retries in the background
    failures = c.failures + 1
    delay = backoff_delay(failures, p.restart)
    c = c._replace(failures=failures, backoff_until=now + delay, wanted=False, died=False)
    effects: tuple[Effect, ...] = (Notify("start", c.reason, ok=False), Blame("start"),
                                   FailParked("failed", retry_after_s=delay))
    if c.abort is not None:  # a stop or reload came while it failed: carry it out now (a stop takes a new spec)
        follow = Update() if c.abort == "reload" else Stop(c.abort, drain=False)
        swap: tuple[Effect, ...] = (Swap(),) if c.swap and c.abort != "reload" else ()
        c = c._replace(abort=None, auto=False, swap=False)
        return Decision(S.BACKOFF, c, (*effects, *swap, FollowUp(follow)))
    if c.auto:
        return Decision(S.BACKOFF, c, (*effects, *_recover(c, p)))
    return Decision(S.BACKOFF, c, effects)  # a cold start's failure: the next request tries again


def _on_retry(state: State, e: RetryDue, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.BACKOFF or c.closed or not c.auto or backoff_remaining(c, now) > 0:
        return _same(state, c)
    return _cold_start(c, c.reason or "crash", auto=True)  # BACKOFF -> STARTING: the delay is over


def _on_idle(state: State, e: IdleTick, c: Counters, p: Policy, now: float) -> Decision:
    after = idle_after_s(c, p)
    if state is not S.READY or c.draining or c.in_flight or after is None:
        return _same(state, c)
    left = c.idle_since + after - now
    if left > 0:
        return _same(state, c, Arm("idle", left))
    # READY -> STOPPING: idle for idle_timeout_s (or a client's keep-alive)
    return Decision(S.STOPPING, c._replace(then="stop", reason="idle"), (Terminate(),))


def _on_keep_alive(state: State, e: KeepAlive, c: Counters, p: Policy, now: float) -> Decision:
    c = c._replace(keep_s=e.keep_s)
    if state is not S.READY or c.draining or c.in_flight:
        return _same(state, c)  # a start arms the timer with it; so does the last request's Done
    return _same(state, c, *_arm_idle(c, p, now))


def _on_drain_timeout(state: State, e: DrainTimeout, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.READY or not c.draining:
        return _same(state, c)
    return Decision(S.STOPPING, c._replace(draining=False), (Terminate(),))  # READY -> STOPPING, drain over


def _on_update(state: State, e: Update, c: Counters, p: Policy, now: float) -> Decision:
    if c.closed:
        return _same(state, c)
    c = c._replace(keep_s=None)  # a new spec: clients' keep-alive ends
    fresh = c._replace(failures=0, backoff_until=None, swap=False)  # no process to wait for: taken now
    if state is S.STOPPED:
        return _same(state, fresh, Swap())
    if state is S.BACKOFF:
        if c.auto and c.failures <= p.restart.max_retries:  # it was relaunching: BACKOFF -> STARTING, new spec
            cold = _cold_start(fresh, "reload", auto=True)
            return Decision(cold.state, cold.counters, (Swap(), *cold.effects))
        return Decision(S.STOPPED, _resting(fresh), (Disarm("retry"), Swap(), Notify("stop", "reload")))
    if state is S.STARTING:  # waiters stay parked: they get the new spec's process
        return _same(state, c._replace(swap=True, abort="reload"), Abort("reload"))
    if state is S.STOPPING:
        return _same(state, c._replace(swap=True))
    c = c._replace(swap=True, then="start", reason="reload")
    if c.in_flight:  # READY, draining
        return _same(state, c._replace(draining=True), Arm("drain", p.drain_timeout_s), Disarm("idle"))
    return Decision(S.STOPPING, c, (Terminate(),))  # READY -> STOPPING


def _on_retune(state: State, e: Retune, c: Counters, p: Policy, now: float) -> Decision:
    c = c._replace(keep_s=None)  # changed settings: clients' keep-alive ends
    if state is not S.READY:
        return _same(state, c)
    idle = () if c.in_flight or c.draining else _arm_idle(c, p, now)
    return _same(state, c, Watch(), *idle)


def _on_forgive(state: State, e: Forgive, c: Counters, p: Policy, now: float) -> Decision:
    """Deaths a poison request caused come off the failure count; a pending relaunch comes sooner."""
    c = c._replace(failures=max(0, c.failures - e.count))
    if state is not S.BACKOFF or not c.auto or c.backoff_until is None or c.closed:
        return _same(state, c)
    delay = backoff_delay(c.failures, p.restart) if c.failures else 0.0
    if c.backoff_until - now <= delay:
        return _same(state, c)
    c = c._replace(backoff_until=now + delay)
    return _same(state, c, FollowUp(RetryDue()) if delay <= 0 else Arm("retry", delay))


def _on_switched(state: State, e: Switched, c: Counters, p: Policy, now: float) -> Decision:
    if state is not S.READY or c.draining or c.closed:
        return _same(state, c)  # the owner switches only a READY process that keeps serving
    # READY -> READY: a new process took over (a rolling replacement); the old one's requests drain with it
    c = c._replace(generation=c.generation + 1, ready_at=now, idle_since=now, in_flight=0, failures=0,
                   backoff_until=None, keep_s=None, reason=e.reason, died=False)
    restart: tuple[Effect, ...] = (Notify("restart", e.reason),) if e.restart else ()
    return _same(state, c, Notify("start", e.reason), *restart, Watch(), *_arm_idle(c, p, now))


_HANDLERS: dict[type, Callable[[State, Any, Counters, Policy, float], Decision]] = {
    Want: _on_want,
    Done: _on_done,
    Stop: _on_stop,
    Close: _on_close,
    Restart: _on_restart,
    Update: _on_update,
    Retune: _on_retune,
    Started: _on_started,
    Exited: _on_exited,
    Hung: _on_hung,
    Reaped: _on_reaped,
    RetryDue: _on_retry,
    Forgive: _on_forgive,
    IdleTick: _on_idle,
    DrainTimeout: _on_drain_timeout,
    KeepAlive: _on_keep_alive,
    Switched: _on_switched,
}
