"""Hot reload: parse fully, diff purely, apply minimally.

``diff(old, new)`` is a pure function of two validated configs. The watcher follows the
config's *directory* (editors save by writing a new file and renaming it over the old one,
which a watch on the file itself loses) and filters events to the file's name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import watchfiles

from modelserver.spec import ModelSpec

__all__ = ["ConfigDiff", "diff", "watch_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConfigDiff:
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def diff(old: Mapping[str, ModelSpec], new: Mapping[str, ModelSpec]) -> ConfigDiff:
    """Models by name: those only in ``new``, those in both but unequal, those only in ``old``."""
    return ConfigDiff(
        added=tuple(sorted(set(new) - set(old))),
        changed=tuple(sorted(name for name in set(old) & set(new) if old[name] != new[name])),
        removed=tuple(sorted(set(old) - set(new))),
    )


async def watch_config(path: Path, on_change: Callable[[], Awaitable[object]], debounce_ms: int = 300) -> None:
    """Call ``on_change`` after each settled change of ``path``; runs until cancelled."""
    target = path.resolve()

    def is_target(_change: watchfiles.Change, changed: str) -> bool:
        return Path(changed).resolve() == target

    log.info("watching %s for changes", target)
    async for _changes in watchfiles.awatch(
        target.parent, watch_filter=is_target, debounce=debounce_ms, recursive=False, rust_timeout=1000
    ):
        if not target.exists():  # mid-rename: the next event brings the new file
            continue
        try:
            await on_change()
        except asyncio.CancelledError:
            raise
        except Exception:  # the watcher must outlive any one bad reload
            log.exception("reload after a change of %s failed", target)
