"""The dashboard's per-model figures from finished requests, and what they keep of each."""

from __future__ import annotations

import gc

from router.api.activity import ModelStats, RequestRecord


def _record(id_: int, started_at: float, status: int, ttft_s: float | None = None, tokens: int | None = None,
            span_s: float = 0.0) -> RequestRecord:
    record = RequestRecord(id_, "m", "/v1/chat/completions", None, started_at, 100.0, status=status, ttft_s=ttft_s)
    if ttft_s is not None:
        record.last_token_t = 100.0 + ttft_s + span_s
        record.completion_tokens = tokens
    return record


def test_figures_count_the_last_minute_the_errors_and_the_token_speeds() -> None:
    stats = ModelStats()
    now = 10_000.0
    stats.add(_record(1, now - 200, 200, ttft_s=0.5, tokens=11, span_s=1.0))  # 10 tokens after the first in 1 s
    stats.add(_record(2, now - 30, 503))
    stats.add(_record(3, now - 5, 200, ttft_s=0.1, tokens=21, span_s=1.0))
    stats.add(_record(4, now - 400, 200))  # beyond the 5-minute window
    figures = stats.figures(now)
    assert figures["requests_per_min"] == 2
    assert figures["errors_5m"] == 1
    assert figures["ttft_p50_s"] == 0.3
    assert figures["tokens_per_s"] == 15.0
    assert sum(figures["sparkline"]) == 3 and figures["sparkline"][-1] == 1  # the last 10 s bucket: request 3


def test_a_finished_requests_sample_is_numbers_the_collector_does_not_track() -> None:
    stats = ModelStats()
    stats.add(_record(1, 1.0, 200, ttft_s=0.2, tokens=5, span_s=0.5))
    gc.collect()
    assert not any(gc.is_tracked(sample) for sample in stats._done)
