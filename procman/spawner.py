"""The OS boundary: starting a process in its own group and reading its output line by line.

The real :class:`SubprocessSpawner` puts every child in a new session (its own process
group, so a stop can signal the whole group) and, on Linux, sets ``PR_SET_PDEATHSIG`` to
SIGKILL so the child dies with its supervisor even when that one is killed with SIGKILL.
The death signal fires when the *thread* that forked exits: spawn from the event-loop
thread (asyncio and uvloop both fork there), never from a short-lived worker thread.

The death signal reaches only the direct child; its own children (a shell-wrapped
``command:``) are covered by :mod:`procman.watchdog`, a small process that SIGKILLs every
registered process group once the router is gone. The spawner keeps one while any child
runs, and when a child exits it SIGKILLs what the child left in its group before it
forgets the group.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["GroupWatch", "LineCallback", "ProcessHandle", "Spawner", "SubprocessHandle", "SubprocessSpawner", "Where"]

log = logging.getLogger(__name__)

LineCallback = Callable[[str], None]

PR_SET_PDEATHSIG = 1
WATCHDOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
READ_CHUNK_BYTES = 65536
MAX_LINE_BYTES = 16384
#: After the process exits, how long its last output may take to arrive through the pipe.
OUTPUT_DRAIN_S = 1.0


class ProcessHandle(Protocol):
    """A spawned process, as the backend sees it."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int:
        """Wait for the exit (reaping it) and return the exit code; negative = killed by that signal."""
        ...

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group; a group that is already gone is not an error."""
        ...


@dataclass(frozen=True, slots=True)
class Where:
    """Where an engine with nodes runs one process, as procman's placement chose it (the engine never decides).

    ``node`` is the node's id, ``host`` the address the process listens on there, ``resources``
    what the process needs of the node's advertised resources (``{"GPU.0": 1}``). The local
    engine gets no ``Where``: it runs everything here.
    """

    name: str  # the backend's name: the engine's label for the process
    node: str
    host: str
    resources: Mapping[str, float] = field(default_factory=dict)
    node_name: str = ""  # short and unique, for people and /api/models


class Spawner(Protocol):
    """Starts processes. ``on_line`` receives every line of merged stdout/stderr.

    An engine with nodes (:mod:`procman.rayengine`) also takes ``where=`` (procman passes it
    only to such an engine) and has the environment of its node, not the router's: ``env``
    then holds only the backend's own variables.
    """

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback
    ) -> ProcessHandle:
        """Start ``argv``; raises OSError when it cannot be executed."""
        ...


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.warning("prctl is unavailable: children will not die with the router on SIGKILL")
        return None


_PRCTL = _load_prctl()


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: no blocked signals, and SIGKILL when the parent dies."""
    prctl = _PRCTL

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # a mask would be inherited across exec
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


class GroupWatch:
    """The router's side of :mod:`procman.watchdog`: one watchdog process while any group is registered."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._groups: set[int] = set()
        self._reaping: set[asyncio.Task[int]] = set()
        self._starting: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def watch(self, pgid: int) -> None:
        """From now on, ``pgid`` is SIGKILLed if the router dies."""
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:  # two spawns at once share one watchdog
            if self._proc is None or self._proc.returncode is not None:
                await self._start()
        self._groups.add(pgid)
        self._write(f"+ {pgid}\n")

    def forget(self, pgid: int) -> None:
        """``pgid`` is gone; the last one closes the watchdog (it exits at once: nothing left to kill)."""
        if pgid not in self._groups:
            return
        self._groups.discard(pgid)
        self._write(f"- {pgid}\n")
        if not self._groups and self._proc is not None:
            proc, self._proc = self._proc, None
            if proc.stdin is not None:
                proc.stdin.close()
            task = asyncio.get_running_loop().create_task(proc.wait())
            self._reaping.add(task)
            task.add_done_callback(self._reaping.discard)

    async def _start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", WATCHDOG,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        log.debug("process-group watchdog pid=%d", self._proc.pid)

    def _write(self, line: str) -> None:
        proc = self._proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line.encode())
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            log.warning("the process-group watchdog is gone; children may outlive a killed router")


class SubprocessSpawner:
    """Spawns real processes with asyncio (or uvloop) subprocess support."""

    def __init__(self) -> None:
        self.groups = GroupWatch()

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback
    ) -> SubprocessHandle:
        return await self._create(argv, env, cwd, on_line, asyncio.subprocess.DEVNULL)

    async def spawn_fed(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback
    ) -> SubprocessHandle:
        """Like :meth:`spawn`, with a pipe to the process's stdin (:meth:`SubprocessHandle.feed`): a spare
        (:mod:`procman.spare`) waits on it for its assignment, and exits at its end (the router gone)."""
        return await self._create(argv, env, cwd, on_line, asyncio.subprocess.PIPE)

    async def _create(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, on_line: LineCallback, stdin: int
    ) -> SubprocessHandle:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=stdin,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_child_setup(os.getpid()),
        )
        await self.groups.watch(proc.pid)  # its own session: the group id is its pid
        return SubprocessHandle(proc, on_line, self.groups)


class SubprocessHandle:
    """A real child process; its output is pumped into ``on_line`` by a task of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, on_line: LineCallback, groups: GroupWatch) -> None:
        self._proc = proc
        self._groups = groups
        self._on_line = on_line
        assert proc.stdout is not None
        self._pump = asyncio.get_running_loop().create_task(_pump_lines(proc.stdout, self._line))

    def _line(self, line: str) -> None:
        self._on_line(line)

    def redirect(self, on_line: LineCallback) -> None:
        """From the next line on, the output goes to ``on_line`` (a spare handed over to its backend)."""
        self._on_line = on_line

    def feed(self, data: bytes) -> None:
        """Write ``data`` to the stdin pipe of a :meth:`SubprocessSpawner.spawn_fed` process and close it."""
        stdin = self._proc.stdin
        if stdin is None:
            raise RuntimeError(f"pid {self.pid} has no stdin pipe")
        stdin.write(data)
        stdin.close()  # what is buffered is still written

    async def exited(self) -> int:
        """Wait for the exit without the cleanup of :meth:`wait` (whoever owns the process calls that once)."""
        return await self._proc.wait()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        code = await self._proc.wait()
        self.signal_group(signal.SIGKILL)  # what the process left in its group dies with it
        self._groups.forget(self._proc.pid)
        if not self._pump.done():
            # the last lines are still in the pipe; a grandchild holding it open must not block us
            await asyncio.wait({self._pump}, timeout=OUTPUT_DRAIN_S)
            self._pump.cancel()
        transport = getattr(self._proc, "_transport", None)
        if transport is not None:
            transport.close()  # release the pipes now rather than when the loop is gone
        return code

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone (or its group id reused)
            os.killpg(self._proc.pid, sig)

    def stopped(self) -> bool:
        """Stopped by a signal (SIGSTOP, SIGTSTP): state ``T`` in ``/proc`` (False where there is none)."""
        if self._proc.returncode is not None:
            return False
        try:
            with open(f"/proc/{self._proc.pid}/stat", "rb") as stat:
                return stat.read().rpartition(b")")[2].split()[:1] == [b"T"]
        except OSError:
            return False


async def _pump_lines(stream: asyncio.StreamReader, on_line: LineCallback) -> None:
    """Split the stream into lines (over-long ones are cut) and hand each to ``on_line``."""
    pending = b""
    while chunk := await stream.read(READ_CHUNK_BYTES):
        *lines, pending = (pending + chunk).split(b"\n")
        for raw in lines:
            _emit(raw, on_line)
        if len(pending) > MAX_LINE_BYTES:
            _emit(pending, on_line)
            pending = b""
    if pending:
        _emit(pending, on_line)


def _emit(raw: bytes, on_line: LineCallback) -> None:
    text = raw[:MAX_LINE_BYTES].decode("utf-8", errors="replace").rstrip("\r")
    try:
        on_line(text)
    except Exception:
        log.exception("log line callback failed")
