"""The owner of every backend of one router: adds, finds, removes, makes room, shuts them all down."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from procman import rolling
from procman.address import DEFAULT_PORT_RANGE, AddressAllocator
from procman.backend import Backend
from procman.errors import BackendUnavailable
from procman.nodes import Node, Seat, choose_node
from procman.notices import Evicted, N
from procman.placement import NO_CLAIM, Claim, Holder, Placement, format_bytes, place, waiting_words
from procman.prober import HttpProber, Prober
from procman.room import Member, Room, Scope, victims
from procman.runtime import Hook, Runtime, Sleep
from procman.spare import SparePool
from procman.spawner import Spawner, SubprocessSpawner, Where
from procman.spec import BackendSpec
from procman.states import State

__all__ = ["BeforeStart", "ProcessManager"]

log = logging.getLogger(__name__)

#: Extra seconds a shutdown grants beyond the longest stop_timeout_s before it SIGKILLs what is left.
SHUTDOWN_GRACE_S = 10.0
#: Retry-After of a start refused because every model of a scope stayed busy.
BUSY_RETRY_AFTER_S = 5.0

Scopes = Callable[[str], Sequence[Scope]]
Claims = Callable[[str], Claim]
Budgets = Callable[[], Mapping[str, int]]
#: An engine with nodes: the live node list, read afresh before each placement decision.
Cluster = Callable[[], Awaitable[Sequence[Node]]]
#: A step before a backend's start from no process (see :data:`procman.runtime.Hook`).
BeforeStart = Hook[Backend]


class ProcessManager:
    """Backends by name, sharing one runtime directory, address allocator, spawner, prober and clock.

    ``runtime_dir`` holds ``sockets/`` (mode 0700) and ``logs/<name>.log``. ``scopes(name)``
    says which limits a backend's start must fit (``max_loaded_models``, groups): before a
    start from no process the backend awaits :meth:`make_room`, which stops idle backends
    (least recently used first) and waits for them to exit; hooks added with
    :meth:`add_before_start` run before it, and raising BackendUnavailable there refuses the start.

    Memory: ``claims(name)`` says what a backend takes on which device (its size, pinned,
    ``min_residency_s``) and ``budgets()`` the bytes each device allows; :meth:`make_room`
    then also fits the device's budget (:func:`procman.placement.place`), starts one backend
    per budgeted device at a time, and serves waiting starts in arrival order. A rolling
    replacement (``Backend.replace``, :mod:`procman.rolling`) counts both processes while both live
    (``Backend.seats``), and :meth:`can_roll` says whether a second one fits.

    Nodes: with ``cluster`` (an engine with nodes, :mod:`procman.rayengine`), every start is
    also placed on a node (:func:`procman.nodes.choose_node`: budgets per node, a backend's
    ``resources`` as capacity) and the spawner is told where (:class:`procman.spawner.Where`).
    """

    def __init__(
        self,
        runtime_dir: Path,
        *,
        port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
        spawner: Spawner | None = None,
        prober: Prober | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
        scopes: Scopes | None = None,
        claims: Claims | None = None,
        budgets: Budgets | None = None,
        log_lines: int = 1000,
        cluster: Cluster | None = None,
    ) -> None:
        self.runtime_dir = Path(runtime_dir).absolute()
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self._runtime = Runtime[Backend](
            allocator=AddressAllocator(self.runtime_dir, port_range),
            spawner=spawner or SubprocessSpawner(),
            prober=prober or HttpProber(),
            clock=clock,
            sleep=sleep,
            log_dir=self.runtime_dir / "logs",
            room=self._reserve,
            on_change=self._changed,
            log_lines=log_lines,
            locate=self._where if cluster is not None else None,
            fits_beside=lambda backend: self.can_roll(backend.name, self._scopes_of(backend.name)),
            beside=self._reserve_beside,
            switched=self._switched,
        )
        self.cluster = cluster
        self.nodes: Sequence[Node] = ()  # the cluster's nodes at the last placement decision
        self._nodes_known = False
        #: names of the nodes a backend must not start on now (its device is unhealthy there), by backend name
        self.avoid: Callable[[str], Collection[str]] | None = None
        self._placed: dict[str, Node] = {}  # key -> the node its room is held on (an engine with nodes)
        #: per backend with a replacement under way: the keys its replacement's processes held room under at its
        #: last change (seats change only in their backend's own turn, which ends in ``_changed``)
        self._seated: dict[Backend, set[str]] = {}
        self._choice: dict[str, Node] = {}  # key -> the node the last placement decision named
        self.scopes = scopes
        self.claims = claims
        self.budgets = budgets
        self._backends: dict[str, Backend] = {}
        self.backends: Mapping[str, Backend] = MappingProxyType(self._backends)
        self._holding: set[str] = set()  # granted room, process not yet gone
        self._evicting: set[str] = set()
        self._waiting: list[tuple[str, str | None]] = []  # starts waiting for room, in arrival order: (key, device)
        self._change = asyncio.Event()
        self._room_waiters = 0
        self._room_waits: dict[str, str] = {}  # written only by make_room: model -> why its start waits
        #: spare interpreters (a SparePool as the spawner): counted as holders, stopped first for room
        self.spares = spawner if isinstance(spawner, SparePool) else None
        if self.spares is not None:
            self.spares.fits, self.spares.demand, self.spares.on_change = self._spare_fits, self._cold, self._signal

    # -- observers ------------------------------------------------------------------------------

    def subscribe(self, kind: type[N], fn: Callable[[N], None]) -> None:
        """Call ``fn(notice)`` for every ``kind`` notice of any backend (:mod:`procman.notices`), in order of
        subscription; a subscriber that raises is logged and the others still hear it."""
        self._runtime.notices.subscribe(kind, fn)

    def unsubscribe(self, kind: type[N], fn: Callable[[N], None]) -> None:
        self._runtime.notices.unsubscribe(kind, fn)

    def add_before_start(self, hook: BeforeStart) -> None:
        """Run ``hook(backend)`` before every start from no process, after the hooks added before it and before
        the room is made; raising BackendUnavailable refuses the start."""
        self._runtime.before_start.append(hook)

    # -- backends -------------------------------------------------------------------------------

    def add(self, spec: BackendSpec) -> Backend:
        """A new, STOPPED backend; its first ``ensure_ready`` starts it."""
        if spec.name in self._backends:
            raise ValueError(f"a backend named {spec.name!r} already exists; use update() to change it")
        backend = self._backends[spec.name] = Backend(spec, self._runtime)
        return backend

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    async def remove(self, name: str) -> None:
        """Drain, stop and forget ``name``; holders of the Backend then get BackendClosed."""
        backend = self._backends.pop(name, None)
        if backend is not None:
            await backend.close(drain=True)

    async def shutdown(self) -> None:
        """Stop every backend at once (no drain), bounded; whatever outlives the bound is SIGKILLed."""
        if self.spares is not None:
            await self.spares.close()
        backends = list(self._backends.values())
        self._backends.clear()
        if backends:
            bound = max(b.spec.stop_timeout_s for b in backends) + SHUTDOWN_GRACE_S
            closing = [asyncio.ensure_future(b.close(drain=False)) for b in backends]
            done, late = await asyncio.wait(closing, timeout=bound)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("shutdown of a backend failed: %r", task.exception())
            for backend, task in zip(backends, closing, strict=True):
                if task in late:
                    log.error("%s did not stop within %gs; killing its process group", backend.name, bound)
                    backend.kill_now()
                    task.cancel()
        self._runtime.allocator.close()

    # -- room -----------------------------------------------------------------------------------

    def loaded(self) -> list[Member]:
        """Backends that hold memory or the room granted for their start."""
        members = []
        for name in self._holding:
            backend = self._backends.get(name)
            if backend is not None:
                going = name in self._evicting or backend.state is State.STOPPING
                pinned = self._claim(name).pinned or backend.kept_loaded
                members.append(Member(name, backend.is_idle(), backend.last_used or 0.0, going, pinned))
        return members

    def holders(self) -> list[Holder]:
        """What holds memory on each device: loaded backends, and both processes of a rolling change."""
        holders = [self._holder(name, backend, name in self._evicting) for name, backend in self._held()]
        holders += [self._holder(seat.key, b, not seat.starting, seat.starting) for seat, b in self._seats()]
        return holders + self.spares.holders() if self.spares is not None else holders

    def _spare_fits(self, device: str | None, size_bytes: int) -> bool:
        """One more spare interpreter fits: no start waits for room, and the device's budget has its bytes."""
        if self._waiting:
            return False
        figures = self.memory().get(device or "")
        return figures is None or figures["used_bytes"] + size_bytes <= figures["budget_bytes"]

    def _cold(self, serves: Sequence[str]) -> tuple[int, int]:
        """Backends running a command that starts with ``serves``: how many are not running (a cold start
        ahead), and how many are starting."""
        prefix = tuple(serves)
        states = [b.state for b in self._backends.values()
                  if b.spec.argv is not None and b.spec.argv[:len(prefix)] == prefix]
        starting = states.count(State.STARTING)
        return len(states) - starting - states.count(State.READY), starting

    def _held(self) -> Iterator[tuple[str, Backend]]:
        for name in self._holding:
            backend = self._backends.get(name)
            if backend is not None:
                yield name, backend

    def _seats(self) -> Iterator[tuple[rolling.Seat, Backend]]:
        """The processes of replacements that hold room beside their backend's current one."""
        for backend in self._backends.values():
            for seat in backend.seats():
                yield seat, backend

    def _holder(self, key: str, backend: Backend, leaving: bool, starting: bool | None = None) -> Holder:
        claim = self._claim(backend.name)
        ready_at = backend.counters.ready_at
        return Holder(
            key, claim.device, claim.size_bytes, idle=backend.is_idle(), last_used=backend.last_used or 0.0,
            pinned=claim.pinned or backend.kept_loaded, evictable_at=(ready_at or 0.0) + claim.min_residency_s,
            starting=backend.state is State.STARTING if starting is None else starting,
            going=leaving or (starting is None and backend.state is State.STOPPING),
        )

    def _claim(self, name: str) -> Claim:
        return self.claims(name) if self.claims is not None else NO_CLAIM

    def memory(self) -> dict[str, dict[str, int]]:
        """Per budgeted device: its budget and the bytes its holders count (loaded, starting, stopping)."""
        budgets = self.budgets() if self.budgets is not None else {}
        used = dict.fromkeys(budgets, 0)
        for holder in self.holders():
            if holder.device in used:
                used[holder.device] += holder.size_bytes
        return {device: {"budget_bytes": budgets[device], "used_bytes": used[device]} for device in budgets}

    def place(self, key: str, name: str | None = None) -> Placement:
        """Where a start of ``name`` (counted as ``key``) stands against its device's budget now."""
        name = name or key
        claim = self._claim(name)
        budgets = self.budgets() if self.budgets is not None else {}
        holders = self.holders()
        if key != name:  # a rolling start never makes room by stopping the process it replaces
            holders = [dataclasses.replace(h, pinned=True) if h.name == name else h for h in holders]
        ahead = self._ahead(key, claim.device)
        if self.cluster is not None:
            return self._place_on_node(key, name, claim, holders, budgets, ahead)
        return place(key, claim.device, claim.size_bytes, holders, budgets, self._runtime.clock(), queued_ahead=ahead)

    def room_waits(self) -> dict[str, str]:
        """Read-only view (a copy): the models whose start waits for room now, each with one line saying why."""
        return dict(self._room_waits)

    def _wait_line(self, name: str, scopes: Sequence[Scope], room: Room, spot: Placement) -> str:
        if not room.fits:
            scope = room.busy or next(s for s in scopes if s.limit > 0)
            held = ", ".join(sorted(m.name for m in self.loaded() if m.name in scope.members)) or "nothing"
            return f"waiting for a slot: {scope.label} allows {scope.limit} loaded model(s), held by {held}"
        claim = self._claim(name)
        budget = (self.budgets() if self.budgets is not None else {}).get(claim.device or "", 0)
        return waiting_words(name, claim.device or "?", claim.size_bytes, budget, self.holders(), spot.wait)

    def _place_on_node(self, key: str, name: str, claim: Claim, holders: Sequence[Holder],
                       budgets: Mapping[str, int], ahead: bool) -> Placement:
        if not self._nodes_known:  # asked before any start read the cluster: nothing to say yet
            return Placement(False, wait="queued")
        spec = self._spec_of(key, name)
        seats = [Seat(self._placed[h.name].id, h, self._spec_of(h.name, h.name).resources)
                 for h in holders if h.name in self._placed]
        choice = choose_node(key, claim.device, claim.size_bytes, spec.resources, self.nodes, seats, budgets,
                             self._runtime.clock(), pin=spec.node, queued_ahead=ahead,
                             avoid=self.avoid(name) if self.avoid is not None else ())
        if choice.node is not None:
            self._choice[key] = choice.node
        return choice.placement

    def _spec_of(self, key: str, name: str) -> BackendSpec:
        backend = self._backends.get(name) or next((b for seat, b in self._seats() if seat.key == key), None)
        assert backend is not None, key
        return backend.spec

    def _where(self, backend: Backend, key: str) -> Where:
        """The node ``backend``'s start (counted as ``key``) was granted on (procman decided; the engine runs it)."""
        node = self._placed.get(key) or self._choice.get(key)
        if node is None:
            raise BackendUnavailable(f"{backend.name}: no node was chosen for this start")
        return Where(backend.name, node.id, node.ip, dict(backend.spec.resources), node.name)

    def node_of(self, backend: Backend) -> Node | None:
        """The node ``backend`` holds room on (an engine with nodes), else None."""
        return self._placed.get(backend.name) if self._backends.get(backend.name) is backend else None

    def _ahead(self, key: str, device: str | None) -> bool:
        for other, other_device in self._waiting:
            if other == key:
                return False
            if other_device == device:
                return True
        return False

    async def make_room(self, name: str, scopes: Sequence[Scope], timeout_s: float = 180.0, *,
                        key: str | None = None) -> None:
        """Stop least-recently-used idle backends until ``name`` fits every scope and its device's budget.

        Waits (bounded by ``timeout_s``) for victims to exit, for busy backends to become
        idle, for a start on the same device to finish and for earlier waiters, woken by
        every change of any backend (and, for a backend younger than its ``min_residency_s``,
        at the moment it may be stopped), never by a polling timer. Raises
        BackendUnavailable when it can never fit or the room does not come in time.
        ``key`` names a rolling change's new process (it is not ``name`` in the counts).
        """
        key = key or name
        deadline = self._runtime.clock() + timeout_s
        self._waiting.append((key, self._claim(name).device))
        try:
            while True:
                if self.cluster is not None:
                    self.nodes, self._nodes_known = await self.cluster(), True
                room = victims(name, self.loaded(), scopes) if key == name else Room((), True)
                spot = self.place(key, name)
                if spot.never is not None:
                    log.warning("%s", spot.never)
                    raise BackendUnavailable(spot.never)
                for victim in room.stop:
                    self._evict(victim, name, "max_loaded")
                for victim in spot.stop:
                    self._evict(victim, name, "memory")
                if room.fits and spot.fits:
                    if key == name:
                        self._holding.add(name)
                    if key in self._choice:
                        self._placed[key] = self._choice[key]
                    return
                if key == name:
                    self._room_waits[name] = self._wait_line(name, scopes, room, spot)
                now = self._runtime.clock()
                if deadline - now <= 0:
                    raise self._no_room(name, scopes, room, spot)
                wake = deadline - now if spot.retry_at is None else min(deadline, spot.retry_at) - now
                await self._wait_change(max(wake, 0.0))
        finally:
            self._waiting = [w for w in self._waiting if w[0] != key]
            if key == name:
                self._room_waits.pop(name, None)
            self._signal()

    async def _wait_change(self, timeout_s: float) -> None:
        change = asyncio.ensure_future(self._change.wait())
        self._room_waiters += 1
        try:
            await self._runtime.wait_done(change, timeout_s)
        finally:
            self._room_waiters -= 1
            change.cancel()

    def _no_room(self, name: str, scopes: Sequence[Scope], room: Room, spot: Placement) -> BackendUnavailable:
        if not room.fits:
            scope = room.busy or next(s for s in scopes if s.limit > 0)
            busy = ", ".join(sorted(m.name for m in self.loaded() if m.name in scope.members))
            limit = f"{scope.label} allows {scope.limit} loaded model(s)"
            return BackendUnavailable(f"cannot start {name}: {limit} and all are busy ({busy})",
                                      retry_after_s=BUSY_RETRY_AFTER_S)
        resources = self._backends[name].spec.resources if name in self._backends else {}
        if self.cluster is not None and resources:
            wanted = ", ".join(f"{r}: {a:g}" for r, a in resources.items())
            held = ", ".join(sorted(f"{h.name} on {self._placed[h.name].name}" for h in self.holders()
                                    if h.name in self._placed and h.name != name))
            return BackendUnavailable(f"cannot start {name}: no node has {{{wanted}}} free; held by "
                                      f"{held or 'nothing'} ({spot.wait})", retry_after_s=BUSY_RETRY_AFTER_S)
        claim = self._claim(name)
        device = claim.device or "?"
        figures = self.memory().get(device, {"budget_bytes": 0, "used_bytes": 0})
        held = ", ".join(sorted(f"{h.name} ({format_bytes(h.size_bytes)}{'' if h.idle else ', busy'})"
                                for h in self.holders() if h.device == device and h.name != name))
        return BackendUnavailable(
            f"cannot start {name} ({format_bytes(claim.size_bytes)}): memory_budget {device} "
            f"{format_bytes(figures['budget_bytes'])} is held by {held or 'nothing'} ({spot.wait})",
            retry_after_s=BUSY_RETRY_AFTER_S,
        )

    # -- rolling replacements (procman/rolling.py: the backend owns both processes) --------------

    def can_roll(self, name: str, scopes: Sequence[Scope]) -> bool:
        """Whether a second process of ``name`` fits beside the first now, without stopping anything."""
        members = self.loaded()
        for scope in scopes:
            loaded = sum(1 for m in members if m.name in scope.members)
            if scope.limit > 0 and name in scope.members and loaded + 1 > scope.limit:
                return False
        return self.place(rolling.next_key(name), name).fits

    def _scopes_of(self, name: str) -> Sequence[Scope]:
        return self.scopes(name) if self.scopes is not None else ()

    async def _reserve_beside(self, backend: Backend, key: str) -> None:
        """Room for a rolling start's process (counted as ``key``) beside ``backend``'s current one."""
        await self.make_room(backend.name, self._scopes_of(backend.name), backend.spec.startup_timeout_s, key=key)

    def _switched(self, backend: Backend, old_key: str, new_key: str) -> None:
        """A rolling start's process took ``backend``'s name: the nodes their room is held on follow."""
        if backend.name in self._placed:
            self._placed[old_key] = self._placed[backend.name]
        if new_key in self._placed:
            self._placed[backend.name] = self._placed.pop(new_key)

    def _evict(self, victim: str, target: str, reason: str) -> None:
        if self.spares is not None and self.spares.owns(victim):
            self.spares.evict(victim)
            return
        backend = self._backends.get(victim)
        if backend is None or victim in self._evicting:
            return
        claim = self._claim(victim)
        size = f", {format_bytes(claim.size_bytes)} on {claim.device}" if claim.device is not None else ""
        log.info("evicting %s (%s, least recently used idle%s) to start %s", victim, reason, size, target)
        self._evicting.add(victim)
        self._runtime.publish(Evicted(victim, target, reason))
        task = asyncio.ensure_future(backend.stop("evict"))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _reserve(self, backend: Backend) -> None:
        await self.make_room(backend.name, self._scopes_of(backend.name), backend.spec.startup_timeout_s)

    def _changed(self, backend: Backend) -> None:
        state = backend.state
        if self._backends.get(backend.name) is backend:
            if state is State.STOPPED or state is State.BACKOFF:
                self._holding.discard(backend.name)
                self._evicting.discard(backend.name)
                self._placed.pop(backend.name, None)
                if self.spares is not None:
                    self.spares.nudge()  # a cold start may come: keep a spare for it
            elif state is State.READY and backend.name not in self._holding and not backend.spec.remote:
                self._holding.add(backend.name)
                if self.spares is not None:
                    self.spares.nudge()  # maybe no model is stopped any more: its spare goes
        if backend.replacing or backend in self._seated:  # not on a request's admit or done otherwise
            self._reseated(backend)
        self._signal()

    def _reseated(self, backend: Backend) -> None:
        """Forget where the room of ``backend``'s replacement processes that are gone was held."""
        seats = {seat.key for seat in backend.seats()}
        for key in self._seated.pop(backend, set()) - seats:
            self._placed.pop(key, None)
        if seats:
            self._seated[backend] = seats

    def _signal(self) -> None:
        if self._room_waiters:
            self._change.set()
            self._change = asyncio.Event()  # the next waiters wait for the next change
