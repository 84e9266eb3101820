"""The types the model-state modules share: one configured :class:`Model`, and the :class:`Fleet` view of all of them.

:class:`Model` is what the request path holds of a model (its spec, its procman backend, its admission
limiter and suspect lane). :class:`Fleet` is what :class:`~router.state.residency.Residency` reads of
the :class:`~router.state.registry.Registry` that owns it, named here so that residency never imports
the registry (the registry builds its residency: the import goes one way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from modelserver.spec import ModelSpec
from procman import Backend, BackendSpec, ProcessManager, Scope
from router.config import Config
from router.metrics import Metrics
from router.state.lane import SuspectLane
from router.state.limits import Limiter

__all__ = ["Fleet", "Model"]


@dataclass(slots=True)
class Model:
    spec: ModelSpec
    backend: Backend
    limiter: Limiter
    #: The suspect lane: the retries of requests caught together in a death run one at a time, new requests
    #: wait for them (router.path.recovery; waited for outside any lease, never while holding one).
    suspects: SuspectLane = field(default_factory=SuspectLane)
    #: Its model servers answer with heartbeats (router.edge.heartbeat): a request that got none from a process
    #: that died was never begun there, so it cannot be the cause. Written only by router.path.recovery.
    heard: bool = False


class Fleet(Protocol):
    """The configured models and their manager, as :class:`~router.state.registry.Registry` keeps them."""

    @property
    def config(self) -> Config: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def manager(self) -> ProcessManager: ...

    @property
    def models(self) -> Mapping[str, Model]: ...

    def scopes(self, name: str) -> list[Scope]: ...

    def process_spec(self, model: Model) -> BackendSpec: ...
