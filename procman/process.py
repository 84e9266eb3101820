"""The mechanics of one backend process: spawn, wait until ready, watch, terminate.

These functions change no backend state; :mod:`procman.backend` calls them and owns the
state machine. Every wait goes through the runtime's clock and sleep, so unit tests drive
them with a fake clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from procman import deaths
from procman.address import Address, is_address_clash
from procman.deaths import Death
from procman.errors import BackendUnavailable, StartFailed, StartTimeout
from procman.logbuffer import LogBuffer
from procman.prober import Health, health_of
from procman.runtime import Runtime
from procman.spawner import LineCallback, ProcessHandle, Where
from procman.spec import BackendSpec, substitute

__all__ = [
    "Aborted",
    "READY_ENV",
    "READY_PREFIX",
    "Running",
    "Stopped",
    "TOKEN_ENV",
    "child_command",
    "exit_death",
    "exit_words",
    "kill",
    "kill_now",
    "launch",
    "node_lost",
    "signal_name",
    "stopped",
    "terminate",
    "watch",
]

log = logging.getLogger(__name__)

POLL_FIRST_S = 0.02  # readiness polling starts here and doubles...
POLL_MAX_S = 0.5  # ...up to this
CLASH_RETRIES = 5  # ports tried when the child reports its port taken
KILL_REAP_S = 5.0  # how long a SIGKILLed process may take to be reaped
TAIL_LINES = 20  # log lines quoted in a failed start
CAUSE_LINES = 20  # last log lines an exit is classified by (exit_death)
#: The environment variable that hands a process on a node its bearer token (``modelserver`` reads the same name).
TOKEN_ENV = "OVROUTER_MODEL_TOKEN"
#: A process whose spec ``announces_ready`` gets a fresh token in this variable and prints ``READY_PREFIX + token``
#: on stdout once it serves (``modelserver`` reads the same name); procman then stops waiting at once.
READY_ENV = "OVROUTER_READY_TOKEN"
READY_PREFIX = "ovrouter-ready "
ANNOUNCED_POLL_S = 2.0  # a process that announces its readiness is still probed, this seldom (a safety net)


@dataclass(slots=True)
class Running:
    """A spawned process (or a reachable remote) and the task that completes when it exits."""

    address: Address
    handle: ProcessHandle | None
    exited: asyncio.Future[Any]
    log_mark: int = 0
    node: str | None = None  # the node's short name (an engine with nodes); None: this machine
    announced: asyncio.Future[None] | None = None  # done when the process printed its readiness line
    health: Health | None = None  # its last answer to a probe (written only by the probes below)

    @property
    def pid(self) -> int | None:
        return self.handle.pid if self.handle is not None else None

    @property
    def exit_code(self) -> int | None:
        if self.exited.done() and not self.exited.cancelled() and self.exited.exception() is None:
            return int(self.exited.result())
        return None


class Aborted(Exception):
    """A stop interrupted the start; ``running`` is the still-alive process to terminate."""

    def __init__(self, running: Running) -> None:
        super().__init__("start interrupted")
        self.running = running


class Stopped(Aborted):
    """The starting process was found stopped by a signal (SIGSTOP, SIGTSTP): someone outside stopped it, and it
    would hang the start until ``startup_timeout_s``; ``running`` is the still-alive process to kill."""

    def __init__(self, running: Running) -> None:
        super().__init__(running)
        self.args = (f"pid={running.pid} was found stopped by a signal while starting",)


async def launch(
    rt: Runtime[Any], spec: BackendSpec, logs: LogBuffer, abort: asyncio.Event, where: Where | None = None
) -> Running:
    """Spawn and wait for 200 on the health path; a clashing TCP port is retried on the next one.

    ``where``: the node placement chose (an engine with nodes): the process listens on that
    node's address and gets a fresh random bearer token (:data:`TOKEN_ENV`) that it requires.
    Raises StartFailed / StartTimeout (the process is already gone), BackendUnavailable for
    a remote that does not answer or no free address, Aborted when ``abort`` is set, Stopped (an Aborted)
    when the process is found stopped by a signal (asked at each poll: a stopped process never answers).
    """
    if spec.remote:
        return await _reach_remote(rt, spec)
    for _ in range(CLASH_RETRIES):
        address = rt.allocator.allocate(spec.name, spec.transport, where.host if where is not None else None)
        if where is not None:
            address = dataclasses.replace(address, token=secrets.token_urlsafe(32))
        running: Running | None = None
        try:
            running = await _spawn(rt, spec, address, logs, where)
            await _wait_ready(rt, spec, running, logs, abort)
            return running
        except StartFailed as exc:  # the process is gone already
            rt.allocator.release(address)
            if not (address.kind == "tcp" and type(exc) is StartFailed and is_address_clash(exc.log_tail)):
                raise
            log.warning("%s: port %s was taken at start; trying the next one", spec.name, address.port)
        except Aborted:
            raise  # the backend terminates the live process (STARTING -> STOPPING) and releases its address
        except BaseException:  # cancelled: never leave the child behind
            kill_now(running)
            rt.allocator.release(address)
            raise
    raise StartFailed(f"{spec.name}: {CLASH_RETRIES} ports in a row were taken; widen router.port_range")


async def _reach_remote(rt: Runtime[Any], spec: BackendSpec) -> Running:
    assert spec.url is not None
    address = Address(kind="tcp", url=spec.url)
    health = await _probe(rt, spec, address, spec.health_timeout_s)
    if health is None or not health.ok:
        raise BackendUnavailable(
            f"{spec.name}: remote {address.base_url}{spec.health_path} did not answer 200 within "
            f"{spec.health_timeout_s:g}s; check that the server is up and the url is right"
        )
    return Running(address=address, handle=None, exited=asyncio.get_running_loop().create_future(), health=health)


def child_command(spec: BackendSpec, address: Address, inherit: bool = True) -> tuple[list[str], dict[str, str]]:
    """argv and the environment with ``${PORT}`` / ``${SOCKET}`` / ``${HOST}`` filled in.

    ``inherit``: start from the router's environment (a local child); a process on a node gets
    only the backend's own variables (and its token), over the environment of its node.
    """
    values = {"${HOST}": address.host, "${PORT}": str(address.port or ""), "${SOCKET}": address.path or ""}
    env = dict(os.environ) if inherit else {}
    env.setdefault("PYTHONUNBUFFERED", "1")  # a Python child's last words must reach the log before it dies
    env.update({key: substitute(value, values) for key, value in spec.env.items()})
    if address.token is not None:
        env[TOKEN_ENV] = address.token
    return [substitute(part, values) for part in spec.argv or ()], env


async def _spawn(
    rt: Runtime[Any], spec: BackendSpec, address: Address, logs: LogBuffer, where: Where | None
) -> Running:
    argv, env = child_command(spec, address, inherit=where is None)
    announced, on_line = _announcement(spec, env, logs.append)
    mark = logs.total
    on = f" on node {where.node_name or where.node}" if where is not None else ""
    try:
        if where is None:
            handle = await rt.spawner.spawn(argv, env, spec.cwd, on_line)
        else:
            handle = await rt.spawner.spawn(argv, env, spec.cwd, on_line, where=where)  # type: ignore[call-arg]
    except OSError as exc:
        raise StartFailed(f"{spec.name}: cannot run {argv[0]!r}{on}: {exc.strerror or exc}") from None
    log.info("spawned %s pid=%d%s", spec.name, handle.pid, on)
    log.debug("%s argv=%s address=%s", spec.name, argv, address)
    logs.note(f"spawned pid={handle.pid}{on} address={address} argv={argv}")
    node = (where.node_name or where.node) if where is not None else None
    return Running(address=address, handle=handle, exited=asyncio.ensure_future(handle.wait()), log_mark=mark,
                   node=node, announced=announced)


def _announcement(
    spec: BackendSpec, env: dict[str, str], on_line: LineCallback
) -> tuple[asyncio.Future[None] | None, LineCallback]:
    """For a spec that ``announces_ready``: a fresh token in ``env``, and a line callback that completes the
    returned future on the line ``READY_PREFIX + token`` (a per-spawn token: no other output can pass for it)."""
    if not spec.announces_ready:
        return None, on_line
    token = secrets.token_hex(8)
    env[READY_ENV] = token
    expected = READY_PREFIX + token
    announced: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def feed(line: str) -> None:
        on_line(line)
        if not announced.done() and line == expected:
            announced.set_result(None)

    return announced, feed


async def _first(futures: Iterable[asyncio.Future[Any]]) -> None:
    await asyncio.wait(set(futures), return_when=asyncio.FIRST_COMPLETED)


async def _wait_ready(
    rt: Runtime[Any], spec: BackendSpec, running: Running, logs: LogBuffer, abort: asyncio.Event
) -> None:
    """Poll the health path (growing intervals) until 200; a process that announces its readiness ends the
    wait the moment it does, and is polled only seldom meanwhile."""
    deadline = rt.clock() + spec.startup_timeout_s
    announced = running.announced
    delay = POLL_FIRST_S if announced is None else ANNOUNCED_POLL_S
    aborted = asyncio.ensure_future(abort.wait())
    pending: list[asyncio.Future[Any]] = [aborted]
    watched = [running.exited, aborted, *([announced] if announced is not None else [])]
    try:
        while True:
            remaining = deadline - rt.clock()
            timeout_s = max(min(spec.health_timeout_s, remaining), 0.01)
            probe = asyncio.ensure_future(_probe(rt, spec, running.address, timeout_s))
            pending.append(probe)
            await _first((probe, *watched))
            _check_alive(spec, running, logs, aborted)
            if _is_done(announced) or _probe_ok(spec, probe, running):
                return
            if deadline - rt.clock() <= 0:
                raise _timeout(spec, running, logs)
            timer = asyncio.ensure_future(rt.sleep(min(delay, deadline - rt.clock())))
            pending[1:] = [timer]
            await _first((timer, *watched))
            _check_alive(spec, running, logs, aborted)
            if _is_done(announced):
                return
            delay = min(delay * 2, POLL_MAX_S) if announced is None else ANNOUNCED_POLL_S
    except StartTimeout:
        await terminate(rt, spec, running, logs)
        raise
    finally:
        for future in pending:
            future.cancel()


def _is_done(future: asyncio.Future[Any] | None) -> bool:
    return future is not None and future.done()


def _check_alive(spec: BackendSpec, running: Running, logs: LogBuffer, aborted: asyncio.Future[Any]) -> None:
    if running.exited.done():
        code = running.exit_code
        tail = logs.since(running.log_mark, TAIL_LINES)
        on = f" on node {running.node}" if running.node is not None else ""
        raise StartFailed(_quote(f"{spec.name} exited with code {code} while starting{on}", tail), code, tail)
    if aborted.done():
        raise Aborted(running)
    if stopped(running):
        raise Stopped(running)


async def _probe(rt: Runtime[Any], spec: BackendSpec, address: Address, timeout_s: float) -> Health | None:
    """One health probe with the spec's method: the answer, or None when there was none in time."""
    answer = await rt.prober.check(address, spec.health_path, timeout_s, spec.health_method)
    return None if answer is None else health_of(answer, rt.clock())


def _probe_ok(spec: BackendSpec, probe: asyncio.Future[Any], running: Running) -> bool:
    """Whether the finished ``probe`` got a 200; an answer (any status) becomes ``running.health``."""
    if probe.cancelled():
        return False
    if (error := probe.exception()) is not None:
        log.error("%s: the prober raised %r; counting it as a failed probe", spec.name, error)
        return False
    health: Health | None = probe.result()
    if health is None:
        return False
    running.health = health
    return health.ok


def _timeout(spec: BackendSpec, running: Running, logs: LogBuffer) -> StartTimeout:
    tail = logs.since(running.log_mark, TAIL_LINES)
    limit = f"startup_timeout_s={spec.startup_timeout_s:g}"
    message = f"{spec.name} did not answer 200 on {spec.health_path} within {limit}"
    return StartTimeout(_quote(message, tail), None, tail)


def _quote(message: str, tail: list[str]) -> str:
    if not tail:
        return message + " (it printed nothing)"
    return message + "; last log lines:\n" + "\n".join(tail)


def stopped(running: Running) -> bool:
    """Whether the process is stopped by a signal (SIGSTOP): silent because someone outside stopped it, not by
    its own doing. A handle tells (``stopped()``); one that cannot (a process on a node) never is."""
    check = getattr(running.handle, "stopped", None)
    return callable(check) and check() is True


def exit_death(running: Running, logs: LogBuffer, spec: BackendSpec, in_flight: int) -> Death:
    """The exit of ``running`` (``in_flight`` requests in it), classified by :func:`procman.deaths.of_exit` from
    its code and the last ``CAUSE_LINES`` lines it wrote."""
    tail = logs.since(running.log_mark, CAUSE_LINES)
    return deaths.of_exit(running.exit_code, tail, spec.fatal_patterns, in_flight)


def node_lost(running: Running) -> bool:
    """Whether the process ended because its node (or its actor) went away: an engine with nodes says so on
    its handle (``lost``); a local process never is."""
    return getattr(running.handle, "lost", False) is True


def exit_words(code: int | None) -> str:
    """How a process ended, for people: ``exited with code 3``, ``was killed by SIGKILL (signal 9)``."""
    if code is None:
        return "exited (exit status unknown)"
    if code >= 0:
        return f"exited with code {code}"
    if code == -signal.SIGSTOP:  # no process exits by SIGSTOP: the code of a hang found stopped from outside
        return f"was found stopped by SIGSTOP (signal {-code}) and killed"
    return f"was killed by {signal_name(code)} (signal {-code})"


def signal_name(code: int) -> str:
    """The name of the signal of a negative exit ``code`` (``SIGKILL`` for -9)."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


async def watch(rt: Runtime[Any], current: Callable[[], BackendSpec], running: Running) -> Literal["crash", "hang"]:
    """Return as soon as the process exits ("crash") or fails ``health_failures`` probes in a row ("hang").

    ``current()`` gives the settings of each round, so a retune applies to the next probe.
    ``health_interval_s`` 0: no probe while READY (for servers that a probe disturbs), only the exit.
    A process whose readiness ended without a 200 probe (it announced it) is probed once at once, so its
    ``health`` (what the router shows and measures) is the ready process's from the start; with
    ``health_interval_s`` 0 that one probe is only for its figures (a failed one counts for nothing).
    """
    failed = 0
    first = running.health is None or not running.health.ok
    while True:
        spec = current()
        if spec.health_interval_s <= 0 and not first:
            await asyncio.wait({running.exited})  # never cancels it; a retune restarts this watch
            return "crash"
        if not first and await rt.wait_done(running.exited, spec.health_interval_s):
            return "crash"
        probe = asyncio.ensure_future(_probe(rt, spec, running.address, spec.health_timeout_s))
        try:
            await _first((probe, running.exited))
        finally:
            probe.cancel()
        if running.exited.done():
            return "crash"
        ok = _probe_ok(spec, probe, running)
        if first and spec.health_interval_s <= 0:
            first = False
            continue
        first = False
        failed = 0 if ok else failed + 1
        if failed:
            log.warning("%s health probe failed (%d of %d)", spec.name, failed, spec.health_failures)
        if failed >= spec.health_failures:
            return "hang"


async def terminate(rt: Runtime[Any], spec: BackendSpec, running: Running, logs: LogBuffer | None = None) -> int | None:
    """SIGTERM the group, wait ``stop_timeout_s``, SIGKILL the group, reap. Returns the exit code.

    A process stopped by a signal (SIGSTOP, SIGTSTP) acts on no SIGTERM until it runs again, so it gets a
    SIGCONT after it (as systemd sends one): its stop is then the graceful one, not ``stop_timeout_s`` of
    waiting (10 s by default, during which the model's next start waited too) and a SIGKILL."""
    handle = running.handle
    if handle is None:
        running.exited.cancel()
        return None
    if not running.exited.done():
        handle.signal_group(signal.SIGTERM)
        if stopped(running):
            handle.signal_group(signal.SIGCONT)
        if not await rt.wait_done(running.exited, spec.stop_timeout_s):
            log.warning(
                "%s pid=%d still running %gs after SIGTERM; sending SIGKILL", spec.name, handle.pid, spec.stop_timeout_s
            )
            handle.signal_group(signal.SIGKILL)
            if not await rt.wait_done(running.exited, KILL_REAP_S):
                log.error("%s pid=%d survived SIGKILL for %gs", spec.name, handle.pid, KILL_REAP_S)
    handle.signal_group(signal.SIGKILL)  # whatever it left behind in its process group
    code = running.exit_code
    if logs is not None:
        logs.note(f"pid={handle.pid} exited with code {code}")
    return code


async def kill(rt: Runtime[Any], spec: BackendSpec, running: Running, logs: LogBuffer | None = None) -> int | None:
    """SIGKILL the group at once (a hung or fatally failed process is never asked twice), then reap."""
    handle = running.handle
    if handle is None:
        running.exited.cancel()
        return None
    handle.signal_group(signal.SIGKILL)
    if not await rt.wait_done(running.exited, KILL_REAP_S):
        log.error("%s pid=%d survived SIGKILL for %gs", spec.name, handle.pid, KILL_REAP_S)
    code = running.exit_code
    if logs is not None:
        logs.note(f"pid={handle.pid} killed, exit code {code}")
    return code


def kill_now(running: Running | None) -> None:
    """SIGKILL the group at once (last resort when a bounded shutdown ran out of time)."""
    if running is not None and running.handle is not None:
        with contextlib.suppress(ProcessLookupError):
            running.handle.signal_group(signal.SIGKILL)
