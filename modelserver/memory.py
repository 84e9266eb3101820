"""What this model server's process holds in memory, for the ``memory`` object of ``/health``.

The router budgets memory per device (``router.memory_budget``) from these figures, so
each is measured, never guessed:

- ``rss_bytes`` / ``peak_rss_bytes``: resident memory now and at its peak, from the kernel
  (``/proc/self/status`` ``VmRSS`` / ``VmHWM`` on Linux, ``getrusage`` elsewhere);
- on a GPU device, ``device_memory_bytes``: OpenVINO's ``GPU_MEMORY_STATISTICS`` (bytes
  per allocation type: ``usm_device``, ``usm_host``, ``cl_mem``…) summed, and on Linux the
  DRM ``fdinfo`` of this process (``drm-total-<region>`` or the older ``drm-memory-<region>``
  of each DRM client it holds) as a cross-check; the larger of the two counts. OpenVINO
  reports only what is in use *now*, so ``device_memory_peak_bytes`` is the largest value
  this process has seen (sampled after the load and on every ``/health``);
- ``counted_bytes``: what the router counts against the model's device: the device peak on
  a GPU (the peak RSS where the device reports nothing), the peak RSS elsewhere.

The fake engine (``fake: {memory_mb: N}``) reports ``N`` MiB as its peak and current size
on its device, so budgets can be exercised without real memory.

Nothing here imports OpenVINO unless the device is a GPU: :class:`MemoryMeter` takes a
``gpu_statistics`` callable (tests pass recorded property values).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MemoryMeter",
    "drm_fdinfo_bytes",
    "gpu_statistics_bytes",
    "is_gpu",
    "meter_for",
    "parse_fdinfo",
    "process_rss",
]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
_UNITS = {"": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}
_DRM_KEY = re.compile(r"^drm-(total|memory)-([\w.-]+)$")

GpuStatistics = Callable[[str], Mapping[str, int] | None]


def is_gpu(device: str) -> bool:
    """``GPU``, ``GPU.1``, ``HETERO:GPU.0,CPU``…: any device string that puts work on a GPU."""
    return "GPU" in device.upper()


def process_rss(status_path: Path = Path("/proc/self/status")) -> tuple[int | None, int | None]:
    """(current, peak) resident bytes of this process; None where the OS does not say."""
    try:
        fields = dict(line.split(":", 1) for line in status_path.read_text().splitlines() if ":" in line)
    except OSError:
        return None, _peak_from_rusage()
    return _kib(fields.get("VmRSS")), _kib(fields.get("VmHWM")) or _peak_from_rusage()


def _kib(value: str | None) -> int | None:
    parts = (value or "").split()
    return int(parts[0]) * 1024 if parts and parts[0].isdigit() else None


def _peak_from_rusage() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def gpu_statistics_bytes(statistics: Mapping[str, Any] | None) -> int | None:
    """The sum of ``GPU_MEMORY_STATISTICS`` (bytes per allocation type); None when there is none."""
    if not statistics:
        return None
    values = [int(v) for v in statistics.values() if isinstance(v, int | float) and v >= 0]
    return sum(values) if values else None


def parse_fdinfo(text: str) -> tuple[str | None, dict[str, int]]:
    """(client id, bytes per memory region) of one DRM ``fdinfo`` file; ({}) when it is not a DRM fd.

    ``drm-total-<region>`` wins over the older ``drm-memory-<region>`` for the same region;
    values carry an optional ``KiB``/``MiB``/``GiB`` unit.
    """
    client: str | None = None
    total: dict[str, int] = {}
    legacy: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "drm-client-id":
            client = value
            continue
        match = _DRM_KEY.match(key)
        amount = _amount(value)
        if match is None or amount is None or match.group(2).startswith("cycles-"):  # xe: drm-total-cycles-<engine>
            continue
        (total if match.group(1) == "total" else legacy)[match.group(2)] = amount
    return client, {**legacy, **total}


def _amount(value: str) -> int | None:
    parts = value.split()
    if not parts or not parts[0].isdigit() or (len(parts) > 1 and parts[1] not in _UNITS):
        return None
    return int(parts[0]) * _UNITS[parts[1] if len(parts) > 1 else ""]


def drm_fdinfo_bytes(fdinfo_dir: Path = Path("/proc/self/fdinfo")) -> tuple[int | None, dict[str, int]]:
    """Device memory of this process by DRM region, from ``fdinfo`` (Linux); (None, {}) when there is none.

    Several file descriptors may share one DRM client (``drm-client-id``): each client counts once.
    """
    try:
        entries = list(fdinfo_dir.iterdir())
    except OSError:
        return None, {}
    return _sum_clients(_read_quietly(entry) for entry in entries)


def _read_quietly(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # the fd closed meanwhile
        return ""


def _sum_clients(texts: Iterable[str]) -> tuple[int | None, dict[str, int]]:
    seen: set[str] = set()
    regions: dict[str, int] = {}
    for text in texts:
        if "drm-" not in text:
            continue
        client, amounts = parse_fdinfo(text)
        if not amounts or (client is not None and client in seen):
            continue
        if client is not None:
            seen.add(client)
        for region, amount in amounts.items():
            regions[region] = regions.get(region, 0) + amount
    return (sum(regions.values()) if regions else None), regions


def openvino_gpu_statistics(device: str) -> Mapping[str, int] | None:
    """``GPU_MEMORY_STATISTICS`` of ``device`` from an OpenVINO Core (only called for GPU devices)."""
    import openvino as ov  # noqa: PLC0415 - only GPU models pay for it

    core = _core(ov)
    value = core.get_property(_plain_gpu(device), "GPU_MEMORY_STATISTICS")
    return {str(k): int(v) for k, v in dict(value).items()}


def openvino_gpu_total(device: str) -> int | None:
    """``GPU_DEVICE_TOTAL_MEM_SIZE`` of ``device`` (bytes), or None."""
    import openvino as ov  # noqa: PLC0415

    try:
        return int(_core(ov).get_property(_plain_gpu(device), "GPU_DEVICE_TOTAL_MEM_SIZE"))
    except Exception as exc:  # no such device, an old driver
        log.debug("GPU_DEVICE_TOTAL_MEM_SIZE of %s unavailable: %s", device, exc)
        return None


_CORE: list[Any] = []


def _core(ov: Any) -> Any:
    if not _CORE:
        _CORE.append(ov.Core())
    return _CORE[0]


def _plain_gpu(device: str) -> str:
    """The GPU named in a device string (``HETERO:GPU.1,CPU`` -> ``GPU.1``)."""
    for part in re.split(r"[:,()]", device):
        if part.strip().upper().startswith("GPU"):
            return part.strip()
    return "GPU"


class MemoryMeter:
    """Measures this process on ``/health``; keeps the largest device figure it saw."""

    def __init__(
        self,
        device: str,
        *,
        fake_mb: float | None = None,
        gpu_statistics: GpuStatistics | None = None,
        gpu_total: Callable[[str], int | None] | None = None,
        fdinfo: Callable[[], tuple[int | None, dict[str, int]]] = drm_fdinfo_bytes,
        rss: Callable[[], tuple[int | None, int | None]] = process_rss,
    ) -> None:
        self.device = device
        self.fake_bytes = int(fake_mb * MIB) if fake_mb is not None else None
        self.gpu = is_gpu(device)
        self._gpu_statistics = gpu_statistics or openvino_gpu_statistics
        self._gpu_total = gpu_total or openvino_gpu_total
        self._fdinfo = fdinfo
        self._rss = rss
        self._device_peak: int | None = None
        self._device_total: int | None = None
        self._total_asked = False

    def report(self, engine_loaded: bool = True) -> dict[str, Any]:
        """The ``memory`` object of ``/health``. Device figures only once the engine is loaded."""
        rss, peak = self._rss()
        body: dict[str, Any] = {"device": self.device, "rss_bytes": rss, "peak_rss_bytes": peak}
        if self.fake_bytes is not None:
            return {**body, "fake": True, "rss_bytes": self.fake_bytes, "peak_rss_bytes": self.fake_bytes,
                    **self._device_figures(self.fake_bytes, {"fake": self.fake_bytes}),
                    "counted_bytes": self.fake_bytes}
        device: int | None = None
        if self.gpu and engine_loaded:
            device, sources = self._device_now()
            body.update(self._device_figures(device, sources))
        counted = self._device_peak if self.gpu and self._device_peak else peak
        return {**body, "counted_bytes": counted}

    def _device_figures(self, now: int | None, sources: dict[str, Any]) -> dict[str, Any]:
        if not self.gpu:
            return {}
        if now is not None:
            self._device_peak = max(self._device_peak or 0, now)
        if not self._total_asked and self.fake_bytes is None:
            self._total_asked = True
            self._device_total = self._gpu_total(self.device)
        return {"device_memory_bytes": now, "device_memory_peak_bytes": self._device_peak,
                "device_total_bytes": self._device_total, "sources": sources}

    def _device_now(self) -> tuple[int | None, dict[str, Any]]:
        sources: dict[str, Any] = {}
        try:
            statistics = self._gpu_statistics(self.device)
        except Exception as exc:  # the plugin does not support it here: fdinfo still may
            log.debug("GPU_MEMORY_STATISTICS of %s unavailable: %s", self.device, exc)
            statistics = None
        openvino = gpu_statistics_bytes(statistics)
        if statistics:
            sources["openvino"] = dict(statistics)
        fdinfo, regions = self._fdinfo()
        if regions:
            sources["fdinfo"] = regions
        figures = [x for x in (openvino, fdinfo) if x is not None]
        return (max(figures) if figures else None), sources


def meter_for(spec: Any) -> MemoryMeter:
    """The meter of a model: its device, and the fake engine's configured size."""
    fake_mb = spec.fake.memory_mb if spec.engine == "fake" else None
    return MemoryMeter(spec.device, fake_mb=fake_mb)
