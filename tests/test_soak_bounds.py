"""bench/soak.py's verdict on its samples (the soak itself is `make soak`, outside `make test`)."""

from __future__ import annotations

from bench.soak import Sample, growth


def series(router_rss: list[float], fds: list[int], procs: int = 3) -> list[Sample]:
    return [Sample(float(minute), {"router": (rss, fd, 7), "calm": (64.0, 20, 2)}, procs)
            for minute, (rss, fd) in enumerate(zip(router_rss, fds, strict=True))]


def test_a_flat_run_with_swinging_open_files_passes() -> None:
    assert growth(series([80, 51, 52, 53, 52, 53, 52], [25, 48, 23, 47, 30, 48, 24]), 1, 4) == []


def test_a_climb_past_a_bound_after_warm_up_fails_naming_it() -> None:
    problems = growth(series([200, 50, 60, 80, 100, 120, 140], [25, 30, 40, 50, 60, 70, 80]), 1, 4)
    assert problems == ["router RSS MiB grew 60 -> 140 (bound +48.0)", "router open files grew 40 -> 80 (bound +16)"]


def test_too_few_samples_or_too_many_model_processes_fail() -> None:
    assert "run longer" in growth(series([50, 50], [20, 20]), 1, 4)[0]
    assert growth(series([50] * 4, [20] * 4, procs=9), 1, 4)[0].startswith("9 model processes")
