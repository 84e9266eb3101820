"""Where a backend listens, and handing out those places without clashes.

Unix sockets live in one private directory (mode 0700), one file per process:
``<name>-<n>.sock`` with ``n`` counting every address this allocator handed out, so an old
process still draining and its replacement never share a socket, and only the process's own
release removes its file. TCP ports come from a configured
range on 127.0.0.1; a port is never handed to two backends at once, a port something else
already holds is skipped, and a clash the child reports at start is answered by trying the
next port (no bind-port-0-then-close: another process could take the port in between).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from procman.errors import BackendUnavailable

__all__ = ["DEFAULT_PORT_RANGE", "Address", "AddressAllocator", "is_address_clash", "safe_name", "short_name"]

log = logging.getLogger(__name__)

#: TCP ports handed to backends when nobody says otherwise (the router's ``router.port_range`` default too).
DEFAULT_PORT_RANGE = (20000, 20999)
#: sun_path holds 108 bytes on Linux (104 on macOS), the terminating NUL included.
MAX_SOCKET_PATH = 103

_CLASH = re.compile(r"address already in use|eaddrinuse|errno 98\b|only one usage of each socket address", re.I)
_SAFE = re.compile(r"[A-Za-z0-9._-]{1,48}")


@dataclass(frozen=True, slots=True)
class Address:
    """How to reach a backend: a Unix socket ``path`` or ``host:port``; ``url`` for a remote one.

    ``token``: the bearer token the process requires on every request (a process listening on a
    node's network address, where no 0700 socket directory guards it); never printed.
    """

    kind: Literal["uds", "tcp"]
    path: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    url: str | None = None
    token: str | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """The URL an HTTP client uses; for a Unix socket the client connects to ``path``."""
        if self.url is not None:
            return self.url.rstrip("/")
        if self.kind == "uds":
            return "http://localhost"
        return f"http://{self.host}:{self.port}"

    def __str__(self) -> str:
        if self.kind == "uds":
            return f"unix:{self.path}"
        return self.base_url


def safe_name(name: str) -> str:
    """``name`` when it is a harmless file name, else a short stable hash of it."""
    if _SAFE.fullmatch(name) and name not in {".", ".."}:
        return name
    return short_name(name)


def short_name(name: str) -> str:
    """A short stable file name for ``name`` (15 characters)."""
    return "b-" + hashlib.sha1(name.encode()).hexdigest()[:12]


def is_address_clash(log_lines: list[str]) -> bool:
    """True when a child's last lines say its listening address was taken."""
    return any(_CLASH.search(line) for line in log_lines)


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; refusing to put sockets there")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)
    return path


def _fits(path: Path) -> bool:
    return len(os.fsencode(path)) <= MAX_SOCKET_PATH


def _port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``port`` now (SO_REUSEADDR, like uvicorn); nothing stays bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


class AddressAllocator:
    """Hands out one address per running backend and takes it back when the process is gone."""

    def __init__(self, runtime_dir: Path, port_range: tuple[int, int] = DEFAULT_PORT_RANGE, host: str = "127.0.0.1"):
        low, high = port_range
        if not 0 < low <= high < 65536:
            raise ValueError(f"port_range: expected [low, high] within 1..65535, got {list(port_range)}")
        self._runtime_dir = Path(runtime_dir).absolute()  # children run in other cwds: paths must be absolute
        self._ports = range(low, high + 1)
        self._host = host
        self._cursor = 0
        self._in_use: set[int] = set()
        self._socket_dir: Path | None = None
        self._own_temp_dir = False
        self._sockets = 0  # sockets handed out: the number in the next socket's name

    @property
    def socket_dir(self) -> Path:
        """The private directory of the sockets, created on first use."""
        if self._socket_dir is None:
            self._socket_dir = self._pick_socket_dir()
        return self._socket_dir

    def _pick_socket_dir(self, too_deep: bool = False) -> Path:
        wanted = self._runtime_dir / "sockets"
        if not too_deep and _fits(wanted / f"{short_name('')}-1.sock"):
            return _private_dir(wanted)
        self._own_temp_dir = True  # runtime_dir is too deep for sun_path: a short private dir instead
        path = Path(tempfile.mkdtemp(prefix="ovrouter-"))
        log.info("socket path under %s would be too long; using %s", self._runtime_dir, path)
        return _private_dir(path)

    def allocate(self, name: str, transport: Literal["uds", "tcp"], host: str | None = None) -> Address:
        """A fresh address for ``name``; raises BackendUnavailable when no TCP port is free.

        ``host``: a node's address (an engine with nodes); its ports are not probed from here, a
        clash there is seen in the child's log and answered with the next port."""
        if transport == "uds":
            self._sockets += 1
            path = self.socket_dir / f"{safe_name(name)}-{self._sockets}.sock"
            if not _fits(path):
                path = self.socket_dir / f"{short_name(name)}-{self._sockets}.sock"
            if not _fits(path) and not self._own_temp_dir:  # the numbers grew too long for runtime_dir
                self._socket_dir = self._pick_socket_dir(too_deep=True)
                path = self.socket_dir / f"{short_name(name)}-{self._sockets}.sock"
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # left by a router before this one (its processes are gone with it)
            return Address(kind="uds", path=str(path))
        port = self._next_port(name, probe=host in (None, self._host))
        return Address(kind="tcp", host=host or self._host, port=port)

    def _next_port(self, name: str, probe: bool = True) -> int:
        for step in range(len(self._ports)):
            port = self._ports[(self._cursor + step) % len(self._ports)]
            if port in self._in_use:
                continue
            if probe and not _port_is_free(self._host, port):
                log.info("port %d is taken by another process; %s tries the next one", port, name)
                continue
            self._cursor = (self._cursor + step + 1) % len(self._ports)
            self._in_use.add(port)
            return port
        raise BackendUnavailable(
            f"no free TCP port for {name} in {self._ports.start}-{self._ports.stop - 1}: widen router.port_range"
        )

    def release(self, address: Address | None) -> None:
        """The process behind ``address`` is gone; its port or socket file can be reused."""
        if address is None or address.url is not None:
            return
        if address.kind == "tcp" and address.port is not None:
            self._in_use.discard(address.port)
        elif address.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(address.path)

    def close(self) -> None:
        """Forget every address; remove the socket directory when it was a temporary one."""
        self._in_use.clear()
        if self._socket_dir is not None and self._own_temp_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        self._socket_dir = None
