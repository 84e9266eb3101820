"""router.state.budget (sizes with units, auto) and router.state.sizes (measured peaks persisted, estimates)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from modelserver.spec import build_model_spec
from router.state.budget import budget_device, parse_budget, parse_size, physical_memory_bytes, resolve_budget
from router.state.sizes import ESTIMATE_FACTOR, ESTIMATE_OVERHEAD_BYTES, SizeStore, files_bytes

M = 1024 * 1024
G = 1024 * M


@pytest.mark.parametrize(("text", "expected"), [
    ("12GiB", 12 * G), ("800MB", 800_000_000), ("1.5 GiB", int(1.5 * G)), ("512kib", 512 * 1024), ("10 B", 10),
    ("2TB", 2 * 10**12),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(("value", "fix"), [
    (12, 'write "12MiB" or "12GiB"'), ("12", "expected a size like"), ("12 parsecs", "expected a size like"),
    (True, "expected a size like"), (None, "expected a size like"),
])
def test_parse_size_says_what_to_fix(value: object, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        parse_size(value)


def test_parse_budget() -> None:
    assert parse_budget(None) is None
    assert parse_budget("auto") == "auto"
    parsed = parse_budget({"CPU": "12GiB", "gpu": "80%", "GPU.1": "auto"})
    assert parsed == {"CPU": 12 * G, "GPU.0": 0.8, "GPU.1": "auto"}


@pytest.mark.parametrize(("value", "fix"), [
    ("lots", 'expected "auto" or a mapping'),
    ({"CPU": "0GiB"}, "CPU: a budget must be more than 0 bytes"),
    ({"CPU": "150%"}, r"CPU: a share of the device must be in \(0%, 100%\]"),
    ({"GPU.0": 14}, 'GPU.0: a size needs a unit'),
])
def test_parse_budget_errors(value: object, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        parse_budget(value)


@pytest.mark.parametrize(("device", "counts_on"), [
    ("CPU", "CPU"), ("GPU", "GPU.0"), ("GPU.1", "GPU.1"), ("HETERO:GPU.1,CPU", "GPU.1"), ("AUTO", "CPU"),
    ("NPU", "NPU"), ("gpu.0", "GPU.0"),
])
def test_budget_device(device: str, counts_on: str) -> None:
    assert budget_device(device) == counts_on


def test_resolve_budget_auto() -> None:
    totals = {"CPU": 100 * G, "GPU.0": 16 * G}
    budgets = resolve_budget("auto", ["GPU.0", "GPU.1"], totals.get)
    assert budgets == {"CPU": 80 * G, "GPU.0": int(16 * G * 0.9)}  # GPU.1's total is not known yet: no budget


def test_resolve_budget_mapping() -> None:
    setting = parse_budget({"CPU": "12GiB", "GPU.0": "50%"})
    assert setting is not None and setting != "auto"
    assert resolve_budget(setting, [], {"GPU.0": 16 * G}.get) == {"CPU": 12 * G, "GPU.0": 8 * G}
    assert resolve_budget(None, ["CPU"], lambda d: G) == {}


def test_physical_memory(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16318480 kB\nMemFree:  1 kB\n")
    assert physical_memory_bytes(meminfo) == 16318480 * 1024
    assert (physical_memory_bytes() or 0) > 0


def spec(name: str, **raw: object):  # noqa: ANN201
    return build_model_spec(name, raw)


def test_size_of_a_never_seen_model_is_estimated_from_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "ir"
    folder.mkdir()
    (folder / "openvino_model.bin").write_bytes(b"x" * 4000)
    (folder / "openvino_model.xml").write_bytes(b"x" * 96)
    store = SizeStore(None)
    size = store.size_of(spec("m", path=str(folder), device="GPU"))
    assert size.device == "GPU.0" and size.source == "files"
    assert size.bytes == int(4096 * ESTIMATE_FACTOR) + ESTIMATE_OVERHEAD_BYTES
    assert files_bytes(str(folder / "openvino_model.bin")) == 4000
    assert files_bytes(str(tmp_path / "missing")) is None


def test_size_of_fake_remote_and_unknown() -> None:
    store = SizeStore(None)
    assert store.size_of(spec("r", url="http://127.0.0.1:9")).as_dict() == {"device": None, "bytes": 0,
                                                                             "source": "remote"}
    assert store.size_of(spec("c", command=["srv", "--port", "${PORT}"])).source == "unknown"
    assert store.size_of(spec("f", engine="fake")).source == "unknown"


def test_measured_peak_wins_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "memory.json"
    store = SizeStore(path)
    model = spec("m", path=str(tmp_path), device="CPU")
    assert store.record("m", 10, {"device": "CPU", "counted_bytes": 200 * M})
    assert store.record("m", 10, {"device": "CPU", "counted_bytes": 300 * M})
    assert not store.record("m", 10, {"device": "CPU", "counted_bytes": 250 * M})  # one process: the peak stays
    assert store.size_of(model).bytes == 300 * M and store.size_of(model).source == "measured"
    again = SizeStore(path)  # a restarted router
    assert again.size_of(model).bytes == 300 * M
    assert again.record("m", 11, {"device": "CPU", "counted_bytes": 250 * M})  # a new process: its own peak
    assert again.size_of(model).bytes == 250 * M
    assert json.loads(path.read_text())["models"]["m"]["pid"] == 11


def test_reported_device_total_is_remembered(tmp_path: Path) -> None:
    store = SizeStore(tmp_path / "memory.json")
    store.record("g", 5, {"device": "GPU", "counted_bytes": G, "device_total_bytes": 16 * G})
    assert SizeStore(tmp_path / "memory.json").device_total("GPU.0") == 16 * G


def test_a_broken_store_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "memory.json"
    path.write_text("{not json")
    store = SizeStore(path)
    assert store.models == {}
    assert not store.record("m", 1, "nonsense")


def test_config_memory_budget_is_validated() -> None:
    from router.config import ConfigError, parse_config

    config = parse_config({"router": {"memory_budget": {"CPU": "1GiB", "GPU": "80%"}}}, Path("."))
    assert config.router.memory_budget == {"CPU": G, "GPU.0": 0.8}
    assert parse_config({"router": {"memory_budget": "auto"}}, Path(".")).router.memory_budget == "auto"
    with pytest.raises(ConfigError) as raised:
        parse_config({"router": {"memory_budget": {"CPU": 12}}}, Path("."))
    assert raised.value.errors == ['router.memory_budget: CPU: a size needs a unit: write "12MiB" or "12GiB", '
                                   'got {"CPU": 12}']


def test_model_memory_settings_are_validated() -> None:
    from modelserver.spec import ConfigError

    model = spec("m", engine="fake", pin=True, min_residency_s=5, restart="stop-first", fake={"memory_mb": 300})
    assert (model.pin, model.min_residency_s, model.restart, model.fake.memory_mb) == (True, 5, "stop-first", 300)
    assert SizeStore(None).size_of(model).as_dict() == {"device": "CPU", "bytes": 300 * M, "source": "fake"}
    declared = spec("c", command=["srv", "${PORT}"], memory_mb=2048, device="GPU.1")
    assert SizeStore(None).size_of(declared).as_dict() == {"device": "GPU.1", "bytes": 2 * G, "source": "declared"}
    with pytest.raises(ConfigError, match="models.m.restart: expected one of"):
        spec("m", engine="fake", restart="sometimes")


class _Backend:
    def __init__(self, health: object, pid: int) -> None:
        from procman import State

        self.state, self.last_health, self.pid = State.READY, health, pid


async def test_memory_watch_records_what_the_last_health_answer_reports(tmp_path: Path) -> None:
    from procman.prober import Health
    from router.state.memwatch import MemoryWatch

    store = SizeStore(tmp_path / "memory.json")
    model = spec("m", engine="fake")
    answer = Health(200, {"status": "ready", "memory": {"device": "CPU", "counted_bytes": 42 * M}}, 1.0)
    watch = MemoryWatch(store, lambda: [(model, _Backend(answer, 7))])
    await watch.sample()  # no I/O: procman's probes brought the answer
    assert store.size_of(model).as_dict() == {"device": "CPU", "bytes": 42 * M, "source": "measured"}
    assert watch.reports["m"]["counted_bytes"] == 42 * M
    loading = Health(503, {"status": "loading", "memory": {"device": "CPU", "counted_bytes": 99 * M}}, 2.0)
    await MemoryWatch(store, lambda: [(model, _Backend(loading, 7))]).sample()
    await MemoryWatch(store, lambda: [(model, _Backend(None, 7))]).sample()
    assert store.size_of(model).bytes == 42 * M  # only a ready process's answer is a measurement


async def test_memory_watch_reads_a_command_backends_peak_from_proc(tmp_path: Path) -> None:
    import os

    from router.state.memwatch import MemoryWatch, peak_rss_of

    store = SizeStore(None)
    command = spec("c", command=["srv", "${SOCKET}"])
    await MemoryWatch(store, lambda: [(command, _Backend(None, os.getpid()))]).sample()
    if peak_rss_of(os.getpid()) is not None:  # Linux
        assert store.size_of(command).source == "measured" and store.size_of(command).bytes > 0


def test_budgets_now_resolves_auto_with_reported_gpu_totals(tmp_path: Path) -> None:
    from router.state.memwatch import budgets_now

    store = SizeStore(None)
    models = [spec("g", path=str(tmp_path), device="GPU.1"), spec("r", url="http://127.0.0.1:9", device="GPU.2")]
    assert set(budgets_now("auto", models, store)) == {"CPU"}  # GPU.1's total is not known yet
    store.record("g", 1, {"device": "GPU.1", "counted_bytes": G, "device_total_bytes": 10 * G})
    assert budgets_now("auto", models, store)["GPU.1"] == 9 * G
    assert budgets_now(None, models, store) == {}


def test_a_model_moved_to_another_device_is_estimated_again(tmp_path: Path) -> None:
    store = SizeStore(None)
    store.record("m", 1, {"device": "CPU", "counted_bytes": 300 * M})
    assert store.size_of(spec("m", path=str(tmp_path), device="CPU")).source == "measured"
    assert store.size_of(spec("m", path=str(tmp_path), device="GPU.0")).source != "measured"
