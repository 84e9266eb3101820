"""The request path's tallies read back as prometheus text: bucket edges, +Inf, sums, counters, forget."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import Metrics
from router.tallies import TallyCounter, TallyHistogram


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_histogram_counts_a_sample_in_the_first_bucket_at_or_above_it() -> None:
    registry = CollectorRegistry()
    histogram = TallyHistogram("t_seconds", "test", ["model"], (0.1, 1, 10))
    registry.register(histogram)
    for value in (0.05, 0.1, 0.5, 1.0, 99.0):
        histogram.observe(("m",), value)
    samples = _samples(registry)

    def bucket(le: str) -> float:
        return samples[("t_seconds_bucket", (("le", le), ("model", "m")))]

    assert [bucket(le) for le in ("0.1", "1.0", "10.0", "+Inf")] == [2, 4, 4, 5]  # cumulative, le inclusive
    assert samples[("t_seconds_count", (("model", "m"),))] == 5
    assert abs(samples[("t_seconds_sum", (("model", "m"),))] - 100.65) < 1e-9


def test_counter_sums_by_labels_and_forget_drops_a_models_series() -> None:
    registry = CollectorRegistry()
    counter = TallyCounter("t_requests", "test", ["model", "status"])
    registry.register(counter)
    counter.inc(("a", 200))
    counter.inc(("a", 200))
    counter.inc(("a", 503))
    counter.inc(("b", 200), 5)
    counter.forget("b")
    samples = _samples(registry)
    assert samples[("t_requests_total", (("model", "a"), ("status", "200")))] == 2
    assert samples[("t_requests_total", (("model", "a"), ("status", "503")))] == 1
    assert not any(labels and dict(labels).get("model") == "b" for _, labels in samples)


def test_router_metrics_expose_the_request_figures_under_their_documented_names() -> None:
    metrics = Metrics()
    metrics.observe_request("m", 200, 0.02)
    metrics.observe_activity("m", 0.0, 0.3, 0.01, 7, 11)
    text = metrics.render().decode()
    assert 'ovrouter_requests_total{model="m",status="200"} 1.0' in text
    for name in ("ovrouter_request_duration_seconds_count", "ovrouter_time_to_first_token_seconds_count",
                 "ovrouter_inter_token_latency_seconds_count", "ovrouter_queue_wait_seconds_count"):
        assert f'{name}{{model="m"}} 1.0' in text
    assert 'ovrouter_prompt_tokens_total{model="m"} 7.0' in text
    assert 'ovrouter_completion_tokens_total{model="m"} 11.0' in text
    metrics.forget("m")
    assert 'model="m"' not in metrics.render().decode()
