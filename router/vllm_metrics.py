"""The vLLM metric names, derived at scrape from the router's own figures (``router.metrics_names: [..., vllm]``).

The stock vLLM Grafana boards and alert rules query ``vllm:*`` names labelled ``model_name``.
Nothing new is measured: each family below is an ``ovrouter_*`` one renamed (label ``model``
becomes ``model_name``), so the two can never disagree.

| vLLM name | from | note |
|---|---|---|
| ``vllm:time_to_first_token_seconds`` | ``ovrouter_time_to_first_token_seconds`` | streams only |
| ``vllm:inter_token_latency_seconds`` | ``ovrouter_inter_token_latency_seconds`` | one sample per stream (its mean) |
| ``vllm:e2e_request_latency_seconds`` | ``ovrouter_request_duration_seconds`` | every proxied request |
| ``vllm:prompt_tokens_total`` | ``ovrouter_prompt_tokens_total`` | |
| ``vllm:generation_tokens_total`` | ``ovrouter_completion_tokens_total`` | |
| ``vllm:num_requests_running`` | ``ovrouter_in_flight`` | requests the router has under way |
| ``vllm:num_requests_waiting`` | ``ovrouter_queued`` | waiting for a ``max_concurrency`` slot |
| ``vllm:kv_cache_usage_perc`` | ``ovrouter_backend_kv_cache_usage_ratio`` | 0..1, as vLLM's |
| ``vllm:request_success_total`` | ``ovrouter_requests_total`` with a 2xx status | no ``finished_reason`` label |
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["VLLM_NAMES", "VllmNames"]

#: Every family this collector exposes (the exposition adds ``_total`` to counters).
VLLM_NAMES = (
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc", "vllm:request_success",
)


class Source(Protocol):
    def collect(self) -> Iterable[Metric]: ...


class VllmNames:
    """A collector: ``renames`` (vLLM name, source) plus successes counted from ``requests`` (model, status)."""

    def __init__(self, renames: Sequence[tuple[str, Source]], requests: Source) -> None:
        self.renames = tuple(renames)
        self.requests = requests

    def collect(self) -> Iterator[Metric]:
        for name, source in self.renames:
            for family in source.collect():
                yield _renamed(family, name)
        yield self._successes()

    def _successes(self) -> Metric:
        by_model: dict[str, float] = {}
        for family in self.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("status", "").startswith("2"):
                    model = sample.labels["model"]
                    by_model[model] = by_model.get(model, 0.0) + sample.value
        family = CounterMetricFamily("vllm:request_success", "requests answered with a 2xx status",
                                     labels=["model_name"])
        for model, value in by_model.items():
            family.add_metric([model], value)
        return family


def _renamed(family: Metric, name: str) -> Metric:
    renamed = Metric(name, family.documentation, family.type)
    for sample in family.samples:
        labels = {("model_name" if key == "model" else key): value for key, value in sample.labels.items()}
        renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value)
    return renamed
