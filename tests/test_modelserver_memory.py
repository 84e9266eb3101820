"""modelserver.memory: RSS from the kernel, GPU device memory from recorded property values and fdinfo texts.

The GPU paths cannot run on a machine without an Intel GPU: these tests feed ``MemoryMeter``
values of the shapes OpenVINO's ``GPU_MEMORY_STATISTICS`` and the kernel's DRM ``fdinfo``
documentation give (i915 and xe); they were not captured from a device.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from modelserver.memory import (
    MIB,
    MemoryMeter,
    drm_fdinfo_bytes,
    gpu_statistics_bytes,
    is_gpu,
    parse_fdinfo,
    process_rss,
)

# GPU_MEMORY_STATISTICS as the GPU plugin answers it: bytes per allocation type in use now.
GPU_STATISTICS = {"cl_mem": 0, "unknown": 0, "usm_device": 1_572_864_000, "usm_host": 8_388_608, "usm_shared": 0}

# /proc/<pid>/fdinfo/<fd> of a DRM fd (i915 on a discrete card): memory per region, with units.
I915_FDINFO = """pos:\t0
flags:\t02100002
mnt_id:\t26
drm-driver:\ti915
drm-client-id:\t7
drm-pdev:\t0000:03:00.0
drm-total-system0:\t4732 KiB
drm-shared-system0:\t0
drm-resident-system0:\t4732 KiB
drm-total-stolen-system0:\t0
drm-total-local0:\t1536 MiB
drm-resident-local0:\t1536 MiB
drm-engine-render:\t9288864723 ns
drm-engine-capacity-render:\t1
"""

# xe: vram/gtt regions, and cycle counters that must not be read as memory.
XE_FDINFO = """pos:\t0
drm-driver:\txe
drm-client-id:\t12
drm-pdev:\t0000:00:02.0
drm-total-gtt:\t2048 KiB
drm-total-vram0:\t1 GiB
drm-cycles-rcs:\t28257900
drm-total-cycles-rcs:\t7655183225
"""

# an older i915: drm-memory-<region> only
LEGACY_FDINFO = "drm-driver:\ti915\ndrm-client-id:\t3\ndrm-memory-local0:\t2048 KiB\ndrm-memory-system0:\t4 KiB\n"


def test_is_gpu_knows_device_strings() -> None:
    assert is_gpu("GPU") and is_gpu("GPU.1") and is_gpu("HETERO:GPU.0,CPU")
    assert not is_gpu("CPU") and not is_gpu("NPU")


def test_gpu_statistics_are_summed_over_allocation_types() -> None:
    assert gpu_statistics_bytes(GPU_STATISTICS) == 1_572_864_000 + 8_388_608
    assert gpu_statistics_bytes({}) is None
    assert gpu_statistics_bytes(None) is None


def test_fdinfo_i915_counts_total_per_region_and_skips_engines() -> None:
    client, regions = parse_fdinfo(I915_FDINFO)
    assert client == "7"
    assert regions == {"system0": 4732 * 1024, "stolen-system0": 0, "local0": 1536 * MIB}


def test_fdinfo_xe_skips_cycle_counters() -> None:
    client, regions = parse_fdinfo(XE_FDINFO)
    assert client == "12"
    assert regions == {"gtt": 2048 * 1024, "vram0": 1024 * MIB}


def test_fdinfo_legacy_memory_keys() -> None:
    assert parse_fdinfo(LEGACY_FDINFO)[1] == {"local0": 2 * MIB, "system0": 4096}


def test_fdinfo_not_drm() -> None:
    assert parse_fdinfo("pos:\t0\nflags:\t02\n") == (None, {})


def test_fdinfo_dir_counts_each_client_once(tmp_path: Path) -> None:
    (tmp_path / "3").write_text(I915_FDINFO)
    (tmp_path / "4").write_text(I915_FDINFO)  # a dup() of the same DRM client
    (tmp_path / "5").write_text(XE_FDINFO)
    (tmp_path / "6").write_text("pos:\t0\n")  # a plain file
    total, regions = drm_fdinfo_bytes(tmp_path)
    assert regions["local0"] == 1536 * MIB
    assert total == 4732 * 1024 + 1536 * MIB + 2048 * 1024 + 1024 * MIB


def test_fdinfo_missing_dir(tmp_path: Path) -> None:
    assert drm_fdinfo_bytes(tmp_path / "nope") == (None, {})


def test_process_rss_of_this_process() -> None:
    rss, peak = process_rss()
    assert peak is not None and peak > 0
    if Path("/proc/self/status").exists():
        assert rss is not None and 0 < rss <= peak


def test_process_rss_from_a_status_file(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n")
    assert process_rss(status) == (100 * MIB, 200 * MIB)


def _gpu_meter(statistics: dict[str, int] | None, fdinfo: tuple[int | None, dict[str, int]]) -> MemoryMeter:
    return MemoryMeter(
        "GPU.0",
        gpu_statistics=lambda device: statistics,
        gpu_total=lambda device: 16 * 1024 * MIB,
        fdinfo=lambda: fdinfo,
        rss=lambda: (300 * MIB, 900 * MIB),
    )


def test_gpu_meter_counts_the_larger_source_and_keeps_the_peak() -> None:
    statistics = dict(GPU_STATISTICS)
    meter = _gpu_meter(statistics, (1600 * MIB, {"local0": 1600 * MIB}))
    first = meter.report()
    assert first["device_memory_bytes"] == 1600 * MIB  # fdinfo saw more than OpenVINO's statistics
    assert first["sources"]["openvino"] == GPU_STATISTICS and first["sources"]["fdinfo"] == {"local0": 1600 * MIB}
    assert first["device_total_bytes"] == 16 * 1024 * MIB
    assert first["counted_bytes"] == 1600 * MIB  # a GPU model counts its device memory, not its RSS
    meter._fdinfo = lambda: (None, {})
    statistics["usm_device"] = 100 * MIB  # the KV cache was freed: the peak stays
    later = meter.report()
    assert later["device_memory_bytes"] == 100 * MIB + 8_388_608
    assert later["device_memory_peak_bytes"] == 1600 * MIB
    assert later["counted_bytes"] == 1600 * MIB


def test_gpu_meter_survives_a_plugin_without_statistics() -> None:
    def refuse(device: str) -> dict[str, int]:
        raise RuntimeError("Unsupported property GPU_MEMORY_STATISTICS")

    meter = MemoryMeter("GPU", gpu_statistics=refuse, gpu_total=lambda d: None, fdinfo=lambda: (None, {}),
                        rss=lambda: (1, 2 * MIB))
    report = meter.report()
    assert report["device_memory_bytes"] is None
    assert report["counted_bytes"] == 2 * MIB  # nothing from the device: the peak RSS counts


def test_gpu_meter_asks_the_device_only_once_loaded() -> None:
    asked: list[str] = []
    meter = MemoryMeter("GPU.1", gpu_statistics=lambda d: asked.append(d) or None, gpu_total=lambda d: None,
                        fdinfo=lambda: (None, {}), rss=lambda: (1, 2))
    meter.report(engine_loaded=False)
    assert asked == []
    meter.report()
    assert asked == ["GPU.1"]


def test_cpu_meter_counts_peak_rss_and_never_touches_openvino() -> None:
    def forbidden(device: str) -> None:
        raise AssertionError("a CPU model must not ask the GPU plugin")

    meter = MemoryMeter("CPU", gpu_statistics=forbidden, rss=lambda: (100, 250))
    assert meter.report() == {"device": "CPU", "rss_bytes": 100, "peak_rss_bytes": 250, "counted_bytes": 250}


@pytest.mark.parametrize("device", ["CPU", "GPU.0"])
def test_fake_meter_reports_its_configured_size(device: str) -> None:
    meter = MemoryMeter(device, fake_mb=300, gpu_statistics=lambda d: None, fdinfo=lambda: (None, {}))
    report = meter.report()
    assert report["counted_bytes"] == 300 * MIB and report["peak_rss_bytes"] == 300 * MIB and report["fake"]
    if device == "GPU.0":
        assert report["device_memory_bytes"] == 300 * MIB and report["device_memory_peak_bytes"] == 300 * MIB
