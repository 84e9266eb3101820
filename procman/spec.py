"""What to run for one backend and how to supervise it: a plain, frozen, comparable value.

Two equal ``BackendSpec`` values mean "nothing changed" on a config reload, so every field
is immutable and hashable (``env`` is a :class:`FrozenEnv`, ``argv`` a tuple). Two specs
with the same :attr:`BackendSpec.process_view` differ only in supervision settings, which
a running process takes without a restart (``Backend.retune``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from procman.machine import DEFAULT_POLICY, Policy
from procman.policy import RestartPolicy

__all__ = ["PLACEHOLDERS", "BackendSpec", "FrozenAmounts", "FrozenEnv", "substitute"]

V = TypeVar("V")

#: Tokens replaced in argv and env values at spawn time.
PLACEHOLDERS = ("${PORT}", "${SOCKET}", "${HOST}")


class _FrozenMap(Mapping[str, V]):
    """An immutable, hashable mapping of names, kept as sorted pairs (comparable across reloads)."""

    __slots__ = ("_items",)

    def __init__(self, pairs: Iterable[tuple[str, V]]) -> None:
        self._items: tuple[tuple[str, V], ...] = tuple(sorted(pairs))

    def __getitem__(self, key: str) -> V:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _FrozenMap):
            return self._items == other._items
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self._items)!r})"


class FrozenEnv(_FrozenMap[str]):
    """An immutable, hashable str -> str mapping (extra environment of a backend)."""

    __slots__ = ()

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        for key, value in (items or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"env: keys and values must be strings, got {key!r}: {value!r}")
        super().__init__((items or {}).items())


class FrozenAmounts(_FrozenMap[float]):
    """An immutable, hashable str -> number mapping (the resources a backend needs of a node)."""

    __slots__ = ()

    def __init__(self, items: Mapping[str, float] | None = None) -> None:
        for key, value in (items or {}).items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"resources: expected names with amounts >= 0, got {key!r}: {value!r}")
        super().__init__((key, float(value)) for key, value in (items or {}).items())


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One supervised backend. ``argv`` None means a remote ``url`` that is never spawned."""

    name: str
    argv: tuple[str, ...] | None
    env: Mapping[str, str] = field(default_factory=FrozenEnv)
    cwd: str | None = None
    url: str | None = None
    transport: Literal["uds", "tcp"] = "uds"
    health_path: str = "/health"
    health_method: Literal["GET", "HEAD"] = "GET"
    startup_timeout_s: float = 180.0
    health_interval_s: float = 10.0  # 0 = probe only while starting; then only the exit is watched
    health_timeout_s: float = 5.0
    health_failures: int = 3
    stop_timeout_s: float = 10.0
    idle_timeout_s: float = DEFAULT_POLICY.idle_timeout_s  # 0 = never stop for idleness
    drain_timeout_s: float = DEFAULT_POLICY.drain_timeout_s
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    #: a process that exits non-zero with one of these in its last lines failed fatally, not just crashed
    fatal_patterns: tuple[str, ...] = ()
    #: an engine with nodes: what the process needs of a node's advertised resources ({"GPU.0": 1})
    resources: Mapping[str, float] = field(default_factory=lambda: FrozenAmounts())
    #: an engine with nodes: the node (id, id prefix, name or IP) it must run on; None = any that fits
    node: str | None = None
    #: the process prints ``ovrouter-ready <token>`` once it serves (the token from ``$OVROUTER_READY_TOKEN``,
    #: fresh per spawn): the start ends then, not at the next health probe (``python -m modelserver`` does)
    announces_ready: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", FrozenEnv(self.env))
        if self.argv is not None:
            object.__setattr__(self, "argv", tuple(self.argv))
        object.__setattr__(self, "fatal_patterns", tuple(self.fatal_patterns))
        object.__setattr__(self, "resources", FrozenAmounts(self.resources))
        for problem in self._problems():
            raise ValueError(f"backend {self.name!r}: {problem}")

    def _problems(self) -> Iterator[str]:
        if not self.name:
            yield "name must not be empty"
        if (self.argv is None) == (self.url is None):
            yield "give exactly one of argv (a command to run) or url (a remote server)"
        if self.argv is not None and not self.argv:
            yield "argv must not be empty"
        if self.transport not in ("uds", "tcp"):
            yield f"transport: expected 'uds' or 'tcp', got {self.transport!r}"
        if not self.health_path.startswith("/"):
            yield f"health_path must start with '/', got {self.health_path!r}"
        if self.health_method not in ("GET", "HEAD"):
            yield f"health_method: expected 'GET' or 'HEAD', got {self.health_method!r}"
        if self.argv is not None and self.transport == "uds" and _uses(self, "${PORT}"):
            yield "argv/env use ${PORT} but transport is 'uds': use ${SOCKET} or transport 'tcp'"
        if self.argv is not None and self.transport == "tcp" and _uses(self, "${SOCKET}"):
            yield "argv/env use ${SOCKET} but transport is 'tcp': use ${PORT} or transport 'uds'"
        for name in ("startup_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                yield f"{name}: expected a number > 0, got {getattr(self, name)!r}"
        for name in ("health_interval_s", "stop_timeout_s", "idle_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                yield f"{name}: expected a number >= 0, got {getattr(self, name)!r}"
        if self.health_failures < 1:
            yield f"health_failures: expected an integer >= 1, got {self.health_failures!r}"

    @property
    def process_view(self) -> tuple[object, ...]:
        """What the process sees: two specs with equal views can share a process (the rest is retuned)."""
        return (self.argv, self.env, self.cwd, self.url, self.transport, self.resources, self.node)

    @property
    def tuning(self) -> Policy:
        """The supervision settings :func:`procman.machine.decide` reads."""
        return Policy(restart=self.policy, idle_timeout_s=self.idle_timeout_s, drain_timeout_s=self.drain_timeout_s)

    @property
    def remote(self) -> bool:
        """True for a ``url`` backend: health-checked, never spawned."""
        return self.argv is None


def _uses(spec: BackendSpec, token: str) -> bool:
    return any(token in part for part in (*(spec.argv or ()), *spec.env.values()))


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Replace the ``${PORT}`` / ``${SOCKET}`` / ``${HOST}`` tokens; any other ``$`` is left alone."""
    for token in PLACEHOLDERS:
        if token in text:
            text = text.replace(token, values.get(token, token))
    return text
