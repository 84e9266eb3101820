"""Prometheus metrics of one router, in a registry of its own (tests run several routers)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_START_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.loaded = Gauge(
            "ovrouter_model_loaded", "1 while the model's process is starting or ready", ["model"], registry=r
        )
        self.state = Gauge("ovrouter_model_state", "1 for the model's current state", ["model", "state"], registry=r)
        self.starts = Counter(
            "ovrouter_model_starts", "model process starts", ["model", "reason", "result"], registry=r
        )
        self.restarts = Counter(
            "ovrouter_model_restarts", "relaunches after a failure", ["model", "reason"], registry=r
        )
        self.stops = Counter("ovrouter_model_stops", "deliberate stops", ["model", "reason"], registry=r)
        self.requests = Counter(
            "ovrouter_requests", "proxied requests by final status", ["model", "status"], registry=r
        )
        self.request_duration = Histogram(
            "ovrouter_request_duration_seconds",
            "proxied request time, stream included",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.cold_start = Histogram(
            "ovrouter_cold_start_duration_seconds", "spawn to ready", ["model"], buckets=_START_BUCKETS, registry=r
        )
        self.in_flight = Gauge("ovrouter_in_flight", "requests in flight", ["model"], registry=r)
        self.queued = Gauge("ovrouter_queued", "requests waiting for a slot", ["model"], registry=r)
        self.reloads = Counter("ovrouter_config_reloads", "config reloads", ["result"], registry=r)
        self.config_valid = Gauge("ovrouter_config_valid", "0 while the file on disk fails validation", registry=r)
        self.config_valid.set(1)
        self._request_children: dict[tuple[str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}

    def observe_request(self, model: str, status: int, elapsed_s: float) -> None:
        """The hot path's metrics, with the labelled children cached (``labels()`` costs a lock)."""
        key = (model, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self._request_children[key] = self.requests.labels(model, str(status))
        duration = self._duration_children.get(model)
        if duration is None:
            duration = self._duration_children[model] = self.request_duration.labels(model)
        counter.inc()
        duration.observe(elapsed_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget(self, model: str) -> None:
        """Drop the per-model series of a model that left the config."""
        self._request_children = {k: v for k, v in self._request_children.items() if k[0] != model}
        self._duration_children.pop(model, None)
        for metric in (self.loaded, self.in_flight, self.queued):
            try:
                metric.remove(model)
            except KeyError:
                pass
