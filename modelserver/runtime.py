"""The model's engine and its health, shared by the HTTP handlers and the loader thread.

::

    loading --load ok--> ready --fatal engine error--> failed
       └------load failed------------------------------> failed   (final: the process is replaced)

A fatal engine error (a device that must not be touched again) halts the engine at once
(its pump never calls the pipeline again) and, in a real process, exits it as soon as the
failing response is written (:meth:`ModelRuntime.exit_if_failed`), or after
``FATAL_EXIT_GRACE_S`` whatever happens: a wedged OpenCL queue may hang the next call.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from modelserver import startup
from modelserver.errors import LoadError, NotReady
from modelserver.spec import ModelSpec

__all__ = ["FATAL_EXIT_GRACE_S", "SUSPECT_LIMIT", "SUSPECT_WINDOW_S", "ModelRuntime", "Status"]

log = logging.getLogger(__name__)

Status = Literal["loading", "ready", "failed"]

#: Suspect device errors (``suspect_patterns``) this close together fail the process.
SUSPECT_LIMIT = 2
SUSPECT_WINDOW_S = 60.0
#: After a fatal error, the longest a process waits for its response to be written before it exits.
FATAL_EXIT_GRACE_S = 2.0


class ModelRuntime:
    """Holds the engine once loaded; ``status`` only moves forward (loading -> ready -> failed)."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        on_fatal: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self.on_fatal = on_fatal  # the real process exits here; in-process apps (tests) just keep a failed runtime
        self._clock = clock
        self._suspects: collections.deque[float] = collections.deque(maxlen=SUSPECT_LIMIT)
        self.status: Status = "loading"
        self.reason: str | None = None
        self.load_failed = False
        self.load_s: float | None = None  # the engine's own load time (pipeline construction), once loaded
        self.started_at = int(time.time())
        self._engine: Any = None
        self._lock = threading.Lock()

    def set_ready(self, engine: Any) -> None:
        with self._lock:
            if self.status == "loading":
                self._engine, self.status = engine, "ready"

    def set_failed(self, reason: str) -> None:
        """A fatal engine error: halt the engine now, exit once the answer is out (or after the grace)."""
        with self._lock:
            if self.status == "failed":
                return
            self.status, self.reason = "failed", reason
            engine = self._engine
        log.error("%s is beyond repair, /health now answers 503: %s", self.spec.name, reason)
        halt = getattr(engine, "halt", None)
        if halt is not None:
            halt()
        if self.on_fatal is not None:
            timer = threading.Timer(FATAL_EXIT_GRACE_S, self.on_fatal)
            timer.daemon = True
            timer.start()

    def suspect(self) -> bool:
        """Record a suspect device error; True when it is the ``SUSPECT_LIMIT``-th within ``SUSPECT_WINDOW_S``."""
        now = self._clock()
        with self._lock:
            self._suspects.append(now)
            return len(self._suspects) == SUSPECT_LIMIT and now - self._suspects[0] <= SUSPECT_WINDOW_S

    def exit_if_failed(self) -> None:
        """After a response went out: a process failed beyond repair exits now (when it has an ``on_fatal``)."""
        if self.status == "failed" and not self.load_failed and self.on_fatal is not None:
            self.on_fatal()

    def loaded(self) -> Any:
        """The engine when ready, else None (for reports: no first-request mark, no error)."""
        return self._engine if self.status == "ready" else None

    def require(self) -> Any:
        """The engine, or :class:`NotReady` while loading and once failed."""
        if self.status == "ready":
            startup.mark("first_request")
            return self._engine
        if self.status == "loading":
            raise NotReady(f"model {self.spec.name!r} is still loading; retry shortly", code="model_loading")
        raise NotReady(f"model {self.spec.name!r} failed and must be restarted: {self.reason}", code="model_failed")

    def health(self) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"status": self.status, "model": self.spec.name, "task": self.spec.task}
        body["startup"] = {**startup.marks(), "engine_load_s": self.load_s}
        if self.status == "ready":
            stats = self._engine.stats()
            stuck_s = float(stats.get("stuck_s") or 0.0)
            if 0 < self.spec.stuck_after_s < stuck_s:  # the pump is wedged (a driver call that never returns)
                reason = (f"no generation step finished for {stuck_s:.0f}s with work waiting "
                          f"(stuck_after_s={self.spec.stuck_after_s:g})")
                return 503, {**body, **stats, "status": "stuck", "reason": reason}
            return 200, {**body, **stats}
        if self.status == "failed":
            body["reason"] = self.reason
        return 503, body

    def load(self, factory: Callable[[ModelSpec], Any]) -> bool:
        """Load the engine with ``factory`` (blocking); logs the outcome and returns whether it worked."""
        started = time.monotonic()
        startup.mark("load_start")
        try:
            engine = factory(self.spec)
        except LoadError as exc:
            return self._load_failed(str(exc))
        except Exception as exc:  # an engine bug or an unexpected OpenVINO error: still one clear line
            log.debug("load of %s raised", self.spec.name, exc_info=True)
            return self._load_failed(f"{type(exc).__name__}: {exc}")
        startup.mark("loaded")
        described = engine.describe()
        self.load_s = described.get("load_s")
        properties = " ".join(f"{key}={value}" for key, value in described.items())
        log.info(
            "loaded %s (task %s) in %.2fs: %s", self.spec.name, self.spec.task, time.monotonic() - started, properties
        )
        self.set_ready(engine)
        return True

    def _load_failed(self, reason: str) -> bool:
        reason = " ".join(reason.split())
        log.error("failed to load %s: %s", self.spec.name, reason)
        with self._lock:
            self.status, self.reason, self.load_failed = "failed", reason, True
        return False

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
