"""Model status as clients read it (the llama.cpp router's model API), and a bus of its changes.

procman's states map onto the four values clients know::

    STOPPED   -> unloaded   (failed when the last start attempt failed)
    STARTING  -> loading    (with an estimated progress once one start has been timed; ``waiting``
                             says why while the start waits for room in the memory budget)
    READY     -> loaded
    STOPPING  -> unloaded
    BACKOFF   -> failed     (a start failed or the process died; the next start waits out a delay)

:class:`StatusBus` subscribes to procman's notices (after the registry, so the metrics move
first) and publishes one ``model_status`` event per change of a model's value on the router's
event bus (data in llama.cpp's shape), plus a progress event every ``progress_interval_s``
while a model loads and somebody listens.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from procman import Backend, Started, State, Stopped, Transition
from router.api.events import EventBus
from router.edge.errors import client_line
from router.service import RouterService
from router.state.registry import Model

__all__ = ["KIND", "MODALITIES", "StatusBus"]

log = logging.getLogger(__name__)

VALUES: dict[State, str] = {
    State.STOPPED: "unloaded",
    State.STARTING: "loading",
    State.READY: "loaded",
    State.STOPPING: "unloaded",
    State.BACKOFF: "failed",
}

#: What each task takes in and gives out, as llama.cpp's ``architecture`` field says it.
MODALITIES: dict[str, tuple[list[str], list[str]]] = {
    "llm": (["text"], ["text"]),
    "vlm": (["text", "image"], ["text"]),
    "embeddings": (["text"], ["embedding"]),
    "rerank": (["text"], ["score"]),
    "transcription": (["audio"], ["text"]),
    "speech": (["text"], ["audio"]),
}

#: The kind of event this module publishes on the router's event bus.
KIND = "model_status"


class StatusBus:
    """Subscriber of every backend's notices and publisher of status events."""

    def __init__(self, service: RouterService, events: EventBus, *, progress_interval_s: float = 0.5) -> None:
        self.service = service
        self.events = events
        self.progress_interval_s = progress_interval_s
        self._last_start_failed: dict[str, bool] = {}
        self._published: dict[str, str] = {}
        self._changed: dict[str, asyncio.Future[None]] = {}
        self._ticker: asyncio.Task[None] | None = None
        manager = service.registry.manager
        manager.subscribe(Transition, self._transition)
        manager.subscribe(Started, self._started)
        manager.subscribe(Stopped, self._stopped)

    # -- reading ------------------------------------------------------------------------------

    def status(self, model: Model) -> dict[str, Any]:
        """The ``status`` object of one model: ``{"value": ...}`` plus what explains it."""
        backend = model.backend
        name = model.spec.name
        value = VALUES[backend.state]
        if value == "unloaded" and backend.state is State.STOPPED and self._last_start_failed.get(name):
            value = "failed"
        status: dict[str, Any] = {"value": value}
        if value == "loading":
            status["progress"] = _progress(backend)
            if (waiting := self.service.registry.manager.room_waits().get(name)) is not None:
                status["waiting"] = waiting  # not loading yet: no process, no memory held
        elif value == "failed":
            status.update(failed=True, exit_code=backend.exit_code)
            if backend.last_error:
                status["last_error"] = client_line(backend.last_error)
            if backend.retry_after_s is not None:
                status["retry_after_s"] = round(backend.retry_after_s, 1)
        return status

    def changed(self, name: str) -> asyncio.Future[None]:
        """A future that resolves at the next state change of model ``name``."""
        future = self._changed.get(name)
        if future is None or future.done():
            future = self._changed[name] = asyncio.get_running_loop().create_future()
        return future

    def refused(self, model: Model) -> None:
        """A load the router refused before it began (it can never fit): ``failed`` until the next start or stop."""
        self._last_start_failed[model.spec.name] = True
        self._publish_change(model.spec.name)

    def event(self, model: Model) -> dict[str, Any]:
        """A llama.cpp ``model_status`` event with the model's current status."""
        status = self.status(model)
        data = {"status": status.pop("value"), **status}
        return {"model": model.spec.name, "event": KIND, "data": data}

    def _publish(self, model: Model) -> str:
        event = self.event(model)
        self.events.publish(KIND, event)
        return str(event["data"]["status"])

    # -- what procman tells ----------------------------------------------------------------------

    def _transition(self, news: Transition) -> None:
        name = news.name
        future = self._changed.pop(name, None)
        if future is not None and not future.done():
            future.set_result(None)
        self._publish_change(name)
        if news.new is State.STARTING:
            self._start_ticker()

    def _publish_change(self, name: str) -> None:
        """Publish the model's status when its value differs from the last one published."""
        model = self.service.registry.models.get(name)
        if model is None:
            return
        if self._published.get(name) != self.status(model)["value"]:
            self._published[name] = self._publish(model)

    def _started(self, news: Started) -> None:
        self._last_start_failed[news.name] = not news.ok
        self._publish_change(news.name)

    def _stopped(self, news: Stopped) -> None:
        self._last_start_failed.pop(news.name, None)  # stopped on purpose: unloaded, not failed
        self._publish_change(news.name)

    # -- load progress ------------------------------------------------------------------------

    def _start_ticker(self) -> None:
        if self.events.subscribers and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="model-status progress")

    async def _tick(self) -> None:
        while self.events.subscribers:
            await asyncio.sleep(self.progress_interval_s)
            loading = [m for m in self.service.registry.models.values() if m.backend.state is State.STARTING]
            if not loading:
                return
            for model in loading:
                self._publish(model)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)


def _progress(backend: Backend) -> dict[str, Any]:
    """How far the start of ``backend`` is, by procman's clock and its last start's duration."""
    elapsed = backend.loading_for_s() or 0.0
    progress: dict[str, Any] = {"elapsed_s": round(elapsed, 2)}
    expected = backend.last_load_s
    if expected:
        progress.update(expected_s=round(expected, 2), value=round(min(elapsed / expected, 0.99), 2))
    return progress
