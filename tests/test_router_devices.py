"""Device health bookkeeping (router/state/devices.py): pure, with a fake clock."""

from __future__ import annotations

from router.state.devices import DeviceHealth


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def health(threshold: int = 3) -> tuple[DeviceHealth, Clock]:
    clock = Clock()
    return DeviceHealth(threshold=threshold, window_s=600, clock=clock, wall=lambda: 1000.0), clock


def test_fatal_errors_of_three_different_models_mark_the_device() -> None:
    devices, _ = health()
    assert devices.record_fatal("GPU.0", "a", "CL_OUT_OF_RESOURCES") is None
    assert devices.record_fatal("GPU.0", "b") is None
    mark = devices.record_fatal("gpu.0", "c", "DEVICE_LOST")
    assert mark is not None and mark.models == ("a", "b", "c")
    assert devices.unhealthy("GPU.0") is mark
    assert "driver reload or reboot may be required" in mark.message() and "GPU.0" in mark.message()


def test_the_same_model_failing_again_counts_once() -> None:
    devices, _ = health()
    for _ in range(5):
        assert devices.record_fatal("GPU.0", "a") is None
    assert devices.record_fatal("GPU.0", "b") is None and devices.unhealthy("GPU.0") is None


def test_errors_older_than_the_window_do_not_count() -> None:
    devices, clock = health()
    devices.record_fatal("GPU.0", "a")
    devices.record_fatal("GPU.0", "b")
    clock.now = 601.0
    assert devices.record_fatal("GPU.0", "c") is None
    assert devices.record_fatal("GPU.0", "d") is None
    assert devices.record_fatal("GPU.0", "e") is not None


def test_other_devices_are_not_affected_and_reset_clears_the_mark() -> None:
    devices, _ = health(threshold=2)
    devices.record_fatal("GPU.0", "a")
    devices.record_fatal("GPU.1", "b")
    assert devices.unhealthy("GPU.0") is None and devices.unhealthy("GPU.1") is None
    devices.record_fatal("GPU.0", "c")
    assert devices.unhealthy("GPU.0") is not None and devices.unhealthy("GPU.1") is None
    rows = devices.snapshot(["CPU", "GPU.0", "GPU.1"])
    assert [(row["device"], row["healthy"]) for row in rows] == [("CPU", True), ("GPU.0", False), ("GPU.1", True)]
    assert devices.reset("GPU.0") is True and devices.unhealthy("GPU.0") is None
    assert devices.reset("GPU.0") is False
    assert devices.record_fatal("GPU.0", "a") is None  # the count starts again after a reset


def test_threshold_zero_never_marks() -> None:
    devices, _ = health(threshold=0)
    for name in "abcdef":
        assert devices.record_fatal("GPU.0", name) is None
