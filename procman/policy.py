"""When to relaunch a backend that failed, and when to give up relaunching it by itself."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestartPolicy", "backoff_delay"]


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How failures (crashes, hangs, fatal errors, failed starts) are retried.

    ``max_retries`` automatic relaunches follow consecutive failures; after that the backend
    stays in BACKOFF and only an on-demand ``ensure_ready`` (once the delay is over) tries
    again. Staying READY for ``stable_after_s`` resets the failure count.
    """

    max_retries: int = 5
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_after_s: float = 30.0

    def __post_init__(self) -> None:
        for field in ("max_retries", "backoff_base_s", "backoff_max_s", "stable_after_s"):
            if getattr(self, field) < 0:
                raise ValueError(f"RestartPolicy.{field}: expected a number >= 0, got {getattr(self, field)!r}")


def backoff_delay(attempt: int, policy: RestartPolicy) -> float:
    """Seconds to wait before the next start after ``attempt`` consecutive failures.

    ``attempt`` 1 is the first failure: a single crash relaunches at once (0 s). From the
    second failure on the delay is ``backoff_base_s`` doubling per failure, capped at
    ``backoff_max_s``. With the defaults: 0, 1, 2, 4, 8, 16, 32, 60, 60, ... seconds.
    """
    if attempt <= 1:
        return 0.0
    exponent = min(attempt - 2, 64)  # 2**64 * base overflows nothing and is far past any cap
    return float(min(policy.backoff_max_s, policy.backoff_base_s * 2.0**exponent))
