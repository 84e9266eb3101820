"""Which node of a cluster one more backend starts on: a pure choice over :func:`procman.placement.place`.

An engine with nodes (:mod:`procman.rayengine`) reports its :class:`Node` list; procman
decides, the engine only runs the process where it is told. Every node has the same
memory budgets (``memory_budget: {CPU: 1GiB}`` applies to each node), and a backend's
``resources`` (``{"GPU.0": 1}``) count against what the node advertises exactly the way
memory counts against a budget: when no node has the resource free, the least recently
used idle holder of it is stopped (never a busy, pinned or young one) rather than leaving
the start pending inside the engine.

:func:`choose_node` answers, for a backend about to start:

- a node where it fits now (the one holding fewest backends);
- else a node where victims are already exiting and nothing more must stop;
- else the node where the fewest least-recently-used idle backends must stop (ties: the
  one whose victims were used longest ago), with those victims;
- else the shortest wait (``stopping``, ``compiling``, ``queued``, ``young``, ``busy``);
- ``never`` when no live node has the resources or every node refuses it for good.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from procman.placement import Holder, Placement, place

__all__ = ["Node", "NodeChoice", "Seat", "choose_node", "node_matches"]

#: Resource amounts are compared in thousandths (place() counts whole bytes).
MILLI = 1000
_WAIT_ORDER = ("stopping", "compiling", "queued", "young", "busy")


@dataclass(frozen=True, slots=True)
class Node:
    """One node of the cluster as the engine sees it now."""

    id: str  # the engine's node id
    name: str  # short and unique (every node may share one IP)
    ip: str  # the address processes on it listen on
    resources: Mapping[str, float] = field(default_factory=dict)  # what it advertises in total
    alive: bool = True


@dataclass(frozen=True, slots=True)
class Seat:
    """A holder (loaded, starting or stopping backend) and the node it holds room on."""

    node: str  # node id
    holder: Holder
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NodeChoice:
    node: Node | None  # where to start (fits) or where room is being made (stop / wait)
    placement: Placement


def node_matches(node: Node, wanted: str) -> bool:
    """Whether ``wanted`` (a config's ``placement.node``) names ``node``: its id, a prefix of it, its name or IP."""
    return wanted in (node.id, node.name, node.ip) or (len(wanted) >= 6 and node.id.startswith(wanted))


def choose_node(
    target: str,
    device: str | None,
    size_bytes: int,
    resources: Mapping[str, float],
    nodes: Sequence[Node],
    seats: Sequence[Seat],
    budgets: Mapping[str, int],
    now: float,
    *,
    pin: str | None = None,
    queued_ahead: bool = False,
    avoid: Collection[str] = (),
) -> NodeChoice:
    """Where ``target`` starts, or what it takes; see the module doc. ``avoid``: names of nodes where
    its device is unhealthy."""
    eligible = [n for n in nodes if n.alive and (pin is None or node_matches(n, pin))]
    eligible = [n for n in eligible if all(n.resources.get(r, 0.0) >= amount for r, amount in resources.items())]
    if not eligible:
        return NodeChoice(None, Placement(False, never=_nowhere(target, resources, nodes, pin)))
    healthy = [n for n in eligible if n.name not in avoid]
    if not healthy:
        names = ", ".join(n.name for n in eligible)
        return NodeChoice(None, Placement(False, never=f"cannot start {target}: its device is unhealthy on every "
                                          f"node that could run it ({names}); see /api/status"))
    eligible = healthy
    options = [(n, _on_node(target, device, size_bytes, resources, n, seats, budgets, now, queued_ahead))
               for n in eligible]
    fitting = [(n, p) for n, p in options if p.fits]
    if fitting:
        return NodeChoice(*min(fitting, key=lambda o: sum(1 for s in seats if s.node == o[0].id)))
    freeing = [(n, p) for n, p in options if p.wait == "stopping" and not p.stop]
    if freeing:  # room is already being made there: stopping more elsewhere would only waste a model
        return NodeChoice(*freeing[0])
    last_used = {s.holder.name: s.holder.last_used for s in seats}
    stopping = [(n, p) for n, p in options if p.stop]
    if stopping:
        return NodeChoice(*min(stopping, key=lambda o: (len(o[1].stop), max(last_used.get(v, 0.0) for v in o[1].stop))))
    waiting = [(n, p) for n, p in options if p.never is None]
    if waiting:
        return NodeChoice(*min(waiting, key=lambda o: _WAIT_ORDER.index(o[1].wait or "busy")))
    return NodeChoice(None, options[0][1])


def _nowhere(target: str, resources: Mapping[str, float], nodes: Sequence[Node], pin: str | None) -> str:
    alive = [n for n in nodes if n.alive]
    if pin is not None and not any(node_matches(n, pin) for n in alive):
        known = ", ".join(f"{n.name} ({n.ip})" for n in alive) or "none"
        return f"cannot start {target}: placement.node {pin!r} is not a live node of the cluster (live: {known})"
    wanted = ", ".join(f"{r}: {a:g}" for r, a in resources.items())
    return f"cannot start {target}: no live node advertises {{{wanted}}} ({len(alive)} live node(s))"


def _on_node(
    target: str, device: str | None, size_bytes: int, resources: Mapping[str, float], node: Node,
    seats: Sequence[Seat], budgets: Mapping[str, int], now: float, queued_ahead: bool,
) -> Placement:
    """Memory on the node's budgets and each resource as a capacity: one placement combining all."""
    here = [s for s in seats if s.node == node.id]
    parts = [place(target, device, size_bytes, [s.holder for s in here], budgets, now, queued_ahead=queued_ahead)]
    for resource, amount in resources.items():
        holders = [dataclasses.replace(s.holder, device=resource, size_bytes=_milli(s.resources[resource]))
                   for s in here if s.resources.get(resource)]
        capacity = {resource: _milli(node.resources.get(resource, 0.0))}
        parts.append(place(target, resource, _milli(amount), holders, capacity, now, serialize=False))
    return _combine(parts)


def _milli(amount: float) -> int:
    return round(amount * MILLI)


def _combine(parts: Sequence[Placement]) -> Placement:
    """All must fit; a part that can never fit or must wait without stopping anything decides alone."""
    for part in parts:
        if part.never is not None:
            return part
    if all(p.fits for p in parts):
        return parts[0]
    for part in parts:
        if not part.fits and not part.stop and part.wait != "stopping":
            return part
    stop = tuple(dict.fromkeys(name for p in parts for name in p.stop))
    return Placement(False, stop=stop, wait="stopping")
