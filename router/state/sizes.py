"""How much memory each model takes on its device: measured peaks, remembered under ``state_dir``.

A model server reports in its ``/health`` answer what it counts on its device
(``memory.counted_bytes``: the peak RSS on CPU, the peak device memory on a GPU; see
:mod:`modelserver.memory`). The router keeps, per model, the peak of the *last* process
it measured (a process's peak only grows, so the last sample of a process is its peak)
in ``<state_dir>/memory.json``, so a restarted router knows sizes before the first load.

What a model is taken to need (:meth:`SizeStore.size_of`), first match wins:

1. ``memory_mb`` declared in its config (a ``command:`` backend reports nothing itself);
2. its last measured peak (on the device it is configured for now);
3. the fake engine's configured ``fake.memory_mb``;
4. an estimate: the size of its files (``path``) times :data:`ESTIMATE_FACTOR` plus
   :data:`ESTIMATE_OVERHEAD_BYTES` (the Python and OpenVINO runtime of the process);
5. nothing known (a ``command:`` without ``memory_mb``, never measured): 0, it counts
   only once measured.

A remote ``url:`` backend counts nowhere.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from router.state.budget import budget_device

__all__ = ["ESTIMATE_FACTOR", "ESTIMATE_OVERHEAD_BYTES", "Size", "SizeStore", "files_bytes"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: A never-measured model is estimated at its files' size times this (weights unpacked and
#: compiled, plus the KV cache or activations of a first request)...
ESTIMATE_FACTOR = 2.5
#: ... plus this much for the process itself (interpreter, OpenVINO and GenAI libraries).
#: Measured on CPU (openvino 2026.4, peak RSS after one request): a 5.5 MB reranker 206 MiB,
#: an 18 MB Qwen2 IR 221 MiB, an 88 MB MiniLM IR 293 MiB, a 94 MB Q4_1 GGUF LLM 501 MiB.
ESTIMATE_OVERHEAD_BYTES = 256 * MIB
#: Files scanned at most when sizing a model folder (a wrong path must not walk a whole disk).
MAX_FILES = 10_000

Source = Literal["declared", "measured", "fake", "files", "unknown", "remote"]


@dataclass(frozen=True, slots=True)
class Size:
    """What a model is taken to need on ``device`` and where the figure comes from."""

    device: str | None  # the budget device; None for a remote backend
    bytes: int
    source: Source

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "bytes": self.bytes, "source": self.source}


def files_bytes(path: str | None) -> int | None:
    """Bytes of a model file or folder (recursively, bounded); None when there is nothing there."""
    if not path:
        return None
    root = Path(path)
    try:
        if root.is_file():
            return root.stat().st_size
        total = 0
        for count, item in enumerate(root.rglob("*")):
            if count >= MAX_FILES:
                break
            if item.is_file():
                total += item.stat().st_size
        return total or None
    except OSError:
        return None


class SizeStore:
    """Measured peaks per model and reported device totals, persisted as JSON at ``path`` (None: in memory)."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self.models: dict[str, dict[str, Any]] = {}
        self.devices: dict[str, dict[str, Any]] = {}
        self._files: dict[str | None, int | None] = {}
        self._load()

    # -- what a model needs ----------------------------------------------------------------

    def size_of(self, spec: Any) -> Size:
        """The size ``spec`` (a ModelSpec) is taken to need on its budget device (see the module doc)."""
        if spec.url is not None:
            return Size(None, 0, "remote")
        device = budget_device(spec.device)
        declared = spec.memory_mb
        if declared:
            return Size(device, int(declared * MIB), "declared")
        seen = self.models.get(spec.name)
        if seen is not None and seen.get("peak_bytes") and seen.get("device") == device:  # a moved model: estimate
            return Size(device, int(seen["peak_bytes"]), "measured")
        fake_mb = spec.fake.memory_mb if spec.engine == "fake" and spec.command is None else None
        if fake_mb:
            return Size(device, int(fake_mb * MIB), "fake")
        if spec.command is None and spec.engine != "fake":
            files = self._files_of(spec.path)
            if files:
                return Size(device, int(files * ESTIMATE_FACTOR) + ESTIMATE_OVERHEAD_BYTES, "files")
        return Size(device, 0, "unknown")

    def _files_of(self, path: str | None) -> int | None:
        if path not in self._files:
            self._files[path] = files_bytes(path)
        return self._files[path]

    def device_total(self, device: str) -> int | None:
        """A GPU's total memory as its model servers reported it (None until one did)."""
        entry = self.devices.get(device)
        return int(entry["total_bytes"]) if entry and entry.get("total_bytes") else None

    # -- what the model servers report --------------------------------------------------------

    def record(self, name: str, pid: int | None, memory: Any) -> bool:
        """Take a ``/health`` ``memory`` object of process ``pid`` of model ``name``; True when it changed the store."""
        if not isinstance(memory, dict):
            return False
        counted = memory.get("counted_bytes")
        changed = False
        if isinstance(counted, int) and counted > 0:
            changed = self._peak(name, pid, counted, str(memory.get("device") or "CPU"))
        total = memory.get("device_total_bytes")
        device = budget_device(str(memory.get("device") or "CPU"))
        if isinstance(total, int) and total > 0 and self.device_total(device) != total:
            self.devices[device] = {"total_bytes": total, "reported_at": self._clock()}
            changed = True
        if changed:
            self.save()
        return changed

    def _peak(self, name: str, pid: int | None, counted: int, device: str) -> bool:
        entry = self.models.get(name)
        if entry is not None and entry.get("pid") == pid and counted <= entry.get("peak_bytes", 0):
            return False
        if entry is not None and entry.get("pid") == pid:
            counted = max(counted, entry.get("peak_bytes", 0))  # one process: its peak only grows
        elif entry is not None:
            log.info("%s: new process pid=%s, peak %s (last process: %s)", name, pid, counted, entry.get("peak_bytes"))
        self.models[name] = {"device": budget_device(device), "peak_bytes": counted, "pid": pid,
                             "measured_at": self._clock()}
        return True

    def forget(self, name: str) -> None:
        if self.models.pop(name, None) is not None:
            self.save()

    # -- persistence ----------------------------------------------------------------------------

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            self.models = {str(k): dict(v) for k, v in (data.get("models") or {}).items() if isinstance(v, dict)}
            self.devices = {str(k): dict(v) for k, v in (data.get("devices") or {}).items() if isinstance(v, dict)}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring %s (%s): sizes will be measured again", self.path, exc)
            self.models, self.devices = {}, {}

    def save(self) -> None:
        """Write atomically (a temporary file renamed over the old one); a failure is logged, never raised."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"models": self.models, "devices": self.devices}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot save measured sizes to %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
