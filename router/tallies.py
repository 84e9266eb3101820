"""Counters and histograms for the request path: plain numbers, turned into prometheus families when scraped.

Every proxied request records seven figures (its status, duration, queue wait, time to first
token, inter-token latency, prompt and completion tokens). prometheus_client's ``inc`` and
``observe`` take a lock and, for a histogram, walk the buckets in Python: ~15 us a request on
the bench machine, a tenth of the router's own cost against a trivial backend. Here a
histogram sample is one ``bisect`` and two additions, a counter one addition; the work of
exposing them is done by :meth:`collect`, when ``/metrics`` is read. Everything runs on the
event loop's thread, as the registry's reader does.

Registered like any collector: ``registry.register(Tally(...))``. Series are keyed by the
tuple of their label values; the first label is the model (``forget`` drops its series).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

__all__ = ["TallyCounter", "TallyHistogram"]

Labels = tuple[object, ...]


class _Tally:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._series: dict[Labels, Any] = {}

    def forget(self, model: str) -> None:
        """Drop every series whose first label is ``model``."""
        for labels in [labels for labels in self._series if labels[0] == model]:
            del self._series[labels]

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def _family(self) -> Metric:
        raise NotImplementedError


class TallyCounter(_Tally):
    """A labelled counter (exposed as ``<name>_total``)."""

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        self._series[labels] = self._series.get(labels, 0.0) + amount

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for labels, value in self._series.items():
            family.add_metric([str(label) for label in labels], value)
        yield family


class TallyHistogram(_Tally):
    """A labelled histogram with fixed bucket bounds (``le``: a sample counts in the first bound >= it)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        self.bounds = tuple(float(bound) for bound in buckets)
        self._les = [repr(bound) for bound in self.bounds] + ["+Inf"]  # as prometheus_client writes ``le``
        # a series: its count per bucket (the last is +Inf), then the sum of its samples

    def observe(self, labels: Labels, value: float) -> None:
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = [0.0] * (len(self.bounds) + 2)
        series[bisect_left(self.bounds, value)] += 1
        series[-1] += value

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for labels, series in self._series.items():
            cumulative = itertools.accumulate(series[:-1])
            family.add_metric([str(label) for label in labels], list(zip(self._les, cumulative, strict=True)),
                              series[-1])
        yield family
