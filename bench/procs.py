"""Processes the bench starts, and the guarantee that every one of them is stopped.

Each child runs in its own session (process group) with ``PR_SET_PDEATHSIG`` on Linux,
so a killed bench leaves nothing behind; :class:`Procs` stops every group it spawned
(SIGTERM, bounded wait, SIGKILL, reap) when its ``with`` block ends — normally, on an
exception, or on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["ROOT", "Procs", "die_with_parent", "free_port", "http_get", "wait_http", "wait_until"]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the bench dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET; status 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback only
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())
    except (OSError, ValueError) as exc:
        log.debug("GET %s: %s", url, exc)
        return 0, repr(exc).encode()


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Poll ``check`` until true; seconds it took. TimeoutError naming ``what`` otherwise."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(interval_s)
    return time.perf_counter() - start


class Procs:
    """Owner of every process the bench starts; a context manager that stops them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._running: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own process group, output to ``log_dir/name.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only a prctl, no locks taken
            )
        self._running.append((name, proc))
        log.info("spawned %s pid=%d", name, proc.pid)
        return proc

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, wait up to ``timeout_s``, SIGKILL it, reap."""
        self._signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("pid=%d ignored SIGTERM for %.0f s, killing", proc.pid, timeout_s)
        self._signal_group(proc, signal.SIGKILL)  # stragglers of the group, too
        proc.wait()
        self._running = [(n, p) for n, p in self._running if p is not proc]

    def stop_all(self) -> None:
        for _, proc in reversed(list(self._running)):
            self.stop(proc)

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, interval_s: float = 0.01) -> float:
    """Poll ``url`` until 200; seconds it took. Fails at once when ``proc`` exits."""

    def ready() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode} before it was ready")
        return http_get(url, timeout_s=1.0)[0] == 200

    return wait_until(ready, timeout_s, f"{url} ready", interval_s)
