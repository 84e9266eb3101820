"""The request-level progress watchdog: what a request's heartbeats say about the process answering it.

The router asks each model server it launched for heartbeats while a request waits for its answer's
head (``x-ovrouter-heartbeat: <beat_s>``; the model server's side and the wire format are in
``modelserver/heartbeat.py``: interim ``102 Processing`` responses, each with the request's progress,
consumed by the router's HTTP client). From them, before any byte of the answer:

- **hung**: no heartbeat for ``silent_s``. The process's event loop stopped (SIGSTOP, a blocked loop,
  a ``[[hang]]``). ``silent_s`` is the silence the health probes need to call a process hung —
  ``health_failures`` probes of ``health_timeout_s``, ``health_interval_s`` apart — so the watchdog
  kills nothing the probes would spare (a long step that holds the GIL silences both), but it sees the
  silence as it passes instead of at the next probe.
- **stalled**: heartbeats keep coming and the request's progress (pieces of text generated) stands
  still for ``stall_s`` (the model's ``stall_timeout_s``, as for a stream). Only time the process showed
  itself alive counts: a gap between heartbeats longer than ``2 * beat_s`` (the process was stopped, or a
  long step held it) adds nothing, so a process stopped and continued is not taken for a stalled one.

The watch is armed by the first heartbeat: a server that sends none (an older model server, another
HTTP server behind ``command:``) is never judged by it. Pure: the caller brings the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ASK_HEADER", "Watch"]

ASK_HEADER = "x-ovrouter-heartbeat"
PROGRESS_HEADER = b"x-progress"
MAX_BEAT_S = 1.0


@dataclass(slots=True)
class Watch:
    """One request's heartbeats: :meth:`beat` as each arrives, :meth:`expired` to ask whether to give up."""

    silent_s: float
    stall_s: float
    beat_s: float = MAX_BEAT_S
    last_beat: float | None = None  # None until the first heartbeat arms the watch
    progress: int | None = None
    still_s: float = 0.0  # time shown alive (heartbeats close together) with the progress unchanged

    @classmethod
    def for_probes(cls, interval_s: float, timeout_s: float, failures: int, stall_s: float) -> Watch:
        """The watch for a model's health settings: hung after the silence its probes would need."""
        silent_s = failures * timeout_s + max(failures - 1, 0) * interval_s
        return cls(silent_s, stall_s, beat_s=min(MAX_BEAT_S, silent_s / 8))

    @property
    def armed(self) -> bool:
        """A heartbeat came: the process began on the request, and its silence now means something."""
        return self.last_beat is not None

    def header(self) -> tuple[str, str]:
        return ASK_HEADER, f"{self.beat_s:g}"

    def beat(self, now: float, progress: int | None) -> None:
        if self.last_beat is not None:
            if progress is None or progress != self.progress:
                self.still_s = 0.0
            elif now - self.last_beat <= 2 * self.beat_s:
                self.still_s += now - self.last_beat
        self.last_beat, self.progress = now, progress

    def expired(self, now: float) -> tuple[Literal["hang", "stall"], str] | None:
        """``("hang", why)``, ``("stall", why)``, or None while the request may go on."""
        if self.last_beat is None:
            return None
        silent = now - self.last_beat
        if silent > self.silent_s:
            return "hang", f"no heartbeat for {silent:.1f}s under a request (silent for over {self.silent_s:g}s)"
        if self.progress is not None and self.still_s > self.stall_s:
            return "stall", f"no progress for {self.still_s:.1f}s under a request (stall_timeout_s={self.stall_s:g})"
        return None

    def check_s(self) -> float:
        """How often to ask :meth:`expired`: a fraction of the shorter bound."""
        return max(0.02, min(self.beat_s, self.silent_s / 10, self.stall_s / 10))
