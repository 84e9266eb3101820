"""Shared fixtures. The autouse leak check makes a child process left behind by a test fail that test."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _children() -> set[int]:
    try:
        return {p.pid for p in psutil.Process(os.getpid()).children(recursive=True) if p.status() != "zombie"}
    except psutil.Error:
        return set()


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """Fail a test that leaves a child process running (a grace for exits under way; a loaded machine is slow)."""
    before = _children()
    yield
    deadline = time.monotonic() + 30.0
    leaked = _children() - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.05)
        leaked = _children() - before
    if leaked:
        names = []
        for pid in leaked:
            try:
                names.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        pytest.fail("test leaked child processes:\n" + "\n".join(names))


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    if not DEMO_GGUF.exists():
        pytest.fail(f"{DEMO_GGUF} is missing: run `make models` (make test does it)")
    return DEMO_GGUF
