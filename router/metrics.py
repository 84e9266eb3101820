"""Prometheus metrics of one router, in a registry of its own (tests run several routers).

``render(names)`` writes the families ``router.metrics_names`` asks for: ``ovrouter`` (this
module's), ``vllm`` (the same figures under vLLM's names, :mod:`router.vllm_metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from router.tallies import TallyCounter, TallyHistogram
from router.vllm_metrics import VllmNames

__all__ = ["Metrics"]

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_START_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: What a model server reports in its /health answer -> (metric name, help).
BACKEND_GAUGES = {
    "running": ("ovrouter_backend_running_requests", "generations running inside the model server"),
    "scheduled_requests": ("ovrouter_backend_scheduled_requests", "requests the pipeline scheduled in its last step"),
    "cache_usage": ("ovrouter_backend_kv_cache_usage_ratio", "KV-cache blocks in use, 0..1 (continuous batching)"),
    "cache_bytes": ("ovrouter_backend_kv_cache_bytes", "KV-cache memory the pipeline allocated"),
    "prefix_prompt_tokens": ("ovrouter_backend_prefix_prompt_tokens", "prompt tokens the process was asked to "
                             "prefill since it started (prefix caching's denominator)"),
    "prefix_cached_tokens": ("ovrouter_backend_prefix_cached_tokens", "of those, tokens served from the prefix cache "
                             "(estimated by whole KV blocks) since the process started"),
    "prefix_cache_hits": ("ovrouter_backend_prefix_cache_hits", "requests that reused a cached prefix since the "
                          "process started"),
    "device_memory_bytes": ("ovrouter_model_device_memory_bytes", "device memory in use, when the device reports it"),
}


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
        self.evictions = Counter("ovrouter_evictions", "models stopped to make room for another, by reason "
                                 "(memory: a device's memory_budget; max_loaded: a count)", ["reason"], registry=r)
        self.memory_budget = Gauge("ovrouter_memory_budget_bytes", "memory_budget of the device", ["device"],
                                   registry=r)
        self.memory_used = Gauge("ovrouter_memory_used_bytes", "what the models loaded, starting or stopping on the "
                                 "device count (measured peaks, else estimates)", ["device"], registry=r)
        self.model_memory = Gauge("ovrouter_model_memory_bytes", "what the model counts on its device's budget",
                                  ["model"], registry=r)
        # the request path's figures are tallies (router/tallies.py: plain numbers, exposed when scraped)
        self.requests = TallyCounter("ovrouter_requests", "proxied requests by final status", ["model", "status"])
        self.request_duration = TallyHistogram(
            "ovrouter_request_duration_seconds", "proxied request time, stream included", ["model"], _DURATION_BUCKETS
        )
        self.cold_start = Histogram(
            "ovrouter_cold_start_duration_seconds", "spawn to ready", ["model"], buckets=_START_BUCKETS, registry=r
        )
        self.in_flight = Gauge("ovrouter_in_flight", "requests in flight", ["model"], registry=r)
        self.queued = Gauge("ovrouter_queued", "requests waiting for a slot", ["model"], registry=r)
        self.reloads = Counter("ovrouter_config_reloads", "config reloads", ["result"], registry=r)
        self.config_valid = Gauge("ovrouter_config_valid", "0 while the file on disk fails validation", registry=r)
        self.config_valid.set(1)
        self.buffered_bodies = Gauge("ovrouter_buffered_body_bytes", "request bodies held in memory, all models "
                                     "(bounded by max_buffered_body_mb)", registry=r)
        self.body_waiters = Gauge("ovrouter_body_waiters", "requests waiting for room under max_buffered_body_mb",
                                  registry=r)
        self._activity(r)
        for tally in self._tallies():
            r.register(tally)
        self.vllm_registry = CollectorRegistry()
        self.vllm_registry.register(VllmNames([
            ("vllm:time_to_first_token_seconds", self.ttft), ("vllm:inter_token_latency_seconds", self.itl),
            ("vllm:e2e_request_latency_seconds", self.request_duration), ("vllm:prompt_tokens", self.prompt_tokens),
            ("vllm:generation_tokens", self.completion_tokens), ("vllm:num_requests_running", self.in_flight),
            ("vllm:num_requests_waiting", self.queued), ("vllm:kv_cache_usage_perc", self.backend["cache_usage"]),
        ], self.requests))

    def _activity(self, r: CollectorRegistry) -> None:
        self.ttft = TallyHistogram("ovrouter_time_to_first_token_seconds", "request arrival to the first streamed "
                                   "token", ["model"], _TTFT_BUCKETS)
        self.itl = TallyHistogram("ovrouter_inter_token_latency_seconds",
                                  "mean time between streamed tokens after the first, one sample per request",
                                  ["model"], _ITL_BUCKETS)
        self.queue_wait = TallyHistogram("ovrouter_queue_wait_seconds",
                                         "time a request waited for a max_concurrency slot", ["model"], _WAIT_BUCKETS)
        self.prompt_tokens = TallyCounter("ovrouter_prompt_tokens", "prompt tokens (from usage)", ["model"])
        self.completion_tokens = TallyCounter("ovrouter_completion_tokens",
                                              "generated tokens (usage, else token events)", ["model"])
        self.rss = Gauge("ovrouter_model_memory_rss_bytes", "resident memory of the model's process (from /proc)",
                         ["model"], registry=r)
        self.backend = {key: Gauge(name, text, ["model"], registry=r) for key, (name, text) in BACKEND_GAUGES.items()}
        self.load_seconds = Gauge("ovrouter_model_last_load_seconds", "duration of the model's last successful start",
                                  ["model"], registry=r)

    def _tallies(self) -> tuple[TallyCounter | TallyHistogram, ...]:
        return (self.requests, self.request_duration, self.ttft, self.itl, self.queue_wait, self.prompt_tokens,
                self.completion_tokens)

    def observe_activity(self, model: str, queue_s: float, ttft_s: float | None, itl_s: float | None,
                         prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """A finished request's figures (see router.api.activity)."""
        key = (model,)
        self.queue_wait.observe(key, queue_s)
        if ttft_s is not None:
            self.ttft.observe(key, ttft_s)
        if itl_s is not None:
            self.itl.observe(key, itl_s)
        if prompt_tokens:
            self.prompt_tokens.inc(key, prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(key, completion_tokens)

    def observe_request(self, model: str, status: int, elapsed_s: float) -> None:
        """A proxied request's final status and duration."""
        self.requests.inc((model, status))
        self.request_duration.observe((model,), elapsed_s)

    def render(self, names: Sequence[str] = ("ovrouter",)) -> bytes:
        """The exposition of the named families (``ovrouter``, ``vllm``), in that order."""
        registries = {"ovrouter": self.registry, "vllm": self.vllm_registry}
        return b"".join(generate_latest(registries[name]) for name in names)

    def forget(self, model: str) -> None:
        """Drop the per-model series of a model that left the config."""
        for tally in self._tallies():
            tally.forget(model)
        for metric in [*vars(self).values(), *self.backend.values()]:
            # every labelled series whose first label is this model, whatever its other labels (state, reason,
            # status): prometheus_client lists a metric's children only in its private ``_metrics``
            if isinstance(metric, MetricWrapperBase) and metric._labelnames[:1] == ("model",):
                for labels in [key for key in list(metric._metrics) if key[0] == model]:
                    metric.remove(*labels)
