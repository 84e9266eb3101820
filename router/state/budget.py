"""``router.memory_budget``: sizes with units, the device a model counts on, and what ``auto`` means.

The setting is ``auto`` or a mapping of device to size::

    memory_budget: auto                        # every device: a fraction of what it has
    memory_budget: {CPU: 12GiB, GPU.0: 14GiB}  # exact sizes (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)
    memory_budget: {CPU: 75%, GPU.0: auto}     # a share of the device's total; auto per device

``auto`` is :data:`AUTO_CPU_FRACTION` of physical memory for ``CPU`` and
:data:`AUTO_GPU_FRACTION` of a GPU's total memory (OpenVINO's ``GPU_DEVICE_TOTAL_MEM_SIZE``,
which a model server on that GPU reports in its ``/health``: the router never loads
OpenVINO, so a GPU's budget exists once one model on it has started, and is remembered
under ``state_dir`` from then on). A device without a budget is not limited by memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from procman.procfs import proc_bytes

__all__ = [
    "AUTO_CPU_FRACTION",
    "AUTO_GPU_FRACTION",
    "budget_device",
    "parse_budget",
    "parse_size",
    "physical_memory_bytes",
    "resolve_budget",
]

#: ``auto`` on CPU: this share of physical memory (the rest is the OS's, the router's and other work's).
AUTO_CPU_FRACTION = 0.8
#: ``auto`` on a GPU: this share of the device's total memory (drivers and the display keep some).
AUTO_GPU_FRACTION = 0.9

_UNITS = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")

#: A parsed budget entry: bytes, a share of the device's total (0..1], or "auto".
Entry = int | float | str


def parse_size(value: object) -> int:
    """``"12GiB"`` -> bytes. Raises ValueError naming the fix (a unit is required)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError('expected a size like "12GiB" or "800MB"')
    if isinstance(value, int | float):
        raise ValueError(f'a size needs a unit: write "{value}MiB" or "{value}GiB"')
    match = _SIZE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f'expected a size like "12GiB", "800MB" or "75%" (units: B, kB..TB, KiB..TiB), not {value!r}')
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _entry(value: object) -> Entry:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str) and (match := _PERCENT.match(value)):
        share = float(match.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(f"a share of the device must be in (0%, 100%], not {value!r}")
        return share
    size = parse_size(value)
    if size <= 0:
        raise ValueError(f"a budget must be more than 0 bytes, got {value!r}")
    return size


def parse_budget(value: Any) -> str | dict[str, Entry] | None:
    """Validate ``router.memory_budget``: None, ``"auto"``, or {device: bytes | share | "auto"}."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if not isinstance(value, Mapping):
        raise ValueError('expected "auto" or a mapping of device to size like {CPU: 12GiB}')
    budget: dict[str, Entry] = {}
    for device, entry in value.items():
        try:
            budget[budget_device(str(device))] = _entry(entry)
        except ValueError as exc:
            raise ValueError(f"{device}: {exc}") from None
    return budget


def budget_device(device: str) -> str:
    """The device whose budget a model's ``device`` counts on: its GPU (``GPU`` is ``GPU.0``), NPU, else CPU.

    ``HETERO:GPU.1,CPU`` counts on GPU.1; ``AUTO`` (no list) on CPU.
    """
    for part in re.split(r"[:,()\s]+", device.upper()):
        if part.startswith("GPU"):
            return "GPU.0" if part == "GPU" else part
    return "NPU" if "NPU" in device.upper() else "CPU"


def physical_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Total physical memory (``MemTotal``, else the OS's page count); None when unknown."""
    total = proc_bytes(meminfo, "MemTotal")
    if total is not None:
        return total
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def resolve_budget(
    setting: str | Mapping[str, Entry] | None,
    devices: Iterable[str],
    device_total: Callable[[str], int | None],
) -> dict[str, int]:
    """Budgets in bytes per device, now. ``devices``: the budget devices models use (``auto`` covers them).

    ``device_total(device)`` is the device's total memory (physical memory for CPU, the
    reported total for a GPU) or None while unknown; an entry that needs it is left out
    until it is known.
    """
    if setting is None:
        return {}
    entries: Mapping[str, Entry] = {d: "auto" for d in {"CPU", *devices}} if setting == "auto" else setting  # type: ignore[assignment]
    budgets: dict[str, int] = {}
    for device, entry in entries.items():
        if isinstance(entry, int) and not isinstance(entry, bool):
            budgets[device] = entry
            continue
        total = device_total(device)
        if total is None:
            continue
        share = entry if isinstance(entry, float) else AUTO_CPU_FRACTION if device == "CPU" else AUTO_GPU_FRACTION
        budgets[device] = int(total * share)
    return budgets
