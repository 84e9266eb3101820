"""Shared fixtures. The autouse leak check makes a child process left behind by a test fail that test.

Crashes leave evidence under ``tests/crashes/<run>/`` (see docs/robustness.md): faulthandler's traceback of
every thread of the test process and of every router and model server it starts (``OVROUTER_FAULT_DIR``;
any other Python child prints it to its stderr: ``PYTHONFAULTHANDLER``), and core files (``RLIMIT_CORE``
raised to ``OVROUTER_CORE_MB``, default 1024; ``0`` turns them off) moved there from the repository root,
where the kernel's default ``core`` pattern writes them. Empty traceback files are removed at the end.
"""

from __future__ import annotations

import faulthandler
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CRASHES = ROOT / "tests" / "crashes"
_fault_file: list[IO[str]] = []


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which enables it to stderr
def pytest_configure(config: pytest.Config) -> None:
    run = CRASHES / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    os.environ["OVROUTER_FAULT_DIR"] = os.environ.get("OVROUTER_FAULT_DIR") or str(run)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    folder = Path(os.environ["OVROUTER_FAULT_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    _fault_file.append((folder / f"pytest-{os.getpid()}.txt").open("w"))
    faulthandler.enable(_fault_file[0], all_threads=True)  # instead of pytest's own, to stderr
    core_mb = int(os.environ.get("OVROUTER_CORE_MB", "1024"))
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    limit = core_mb * 1024 * 1024 if hard == resource.RLIM_INFINITY else min(hard, core_mb * 1024 * 1024)
    resource.setrlimit(resource.RLIMIT_CORE, (limit, hard))  # children inherit it
    _keep_cores(folder)  # a crashed earlier run's core files


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = Path(os.environ["OVROUTER_FAULT_DIR"])
    _keep_cores(folder)
    for path in folder.glob("*.txt"):
        if path.stat().st_size == 0 and not (_fault_file and path.name == Path(_fault_file[0].name).name):
            path.unlink()
    if _fault_file and Path(_fault_file[0].name).stat().st_size == 0:
        faulthandler.disable()
        _fault_file[0].close()
        Path(_fault_file[0].name).unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
    if CRASHES.is_dir() and not any(CRASHES.iterdir()):
        CRASHES.rmdir()


def pytest_report_header(config: pytest.Config) -> str:
    found = CRASHES.glob("*/*") if CRASHES.is_dir() else iter(())
    earlier = sorted(str(p.relative_to(ROOT)) for p in found if p.stat().st_size)
    return f"crash evidence (faulthandler, cores): {os.environ['OVROUTER_FAULT_DIR']}" + (
        f"; from earlier runs: {', '.join(earlier[:5])}" if earlier else "")


def _keep_cores(folder: Path) -> None:
    for core in ROOT.glob("core*"):
        if core.is_file() and (core.name == "core" or core.name[5:].isdigit()):
            core.rename(folder / f"{core.name}-{int(core.stat().st_mtime)}")


def _children() -> set[int]:
    """This process's live descendants. One that exits while they are listed is left out, not the whole list
    (an empty "before" would count every module-scoped server as a leak of the test that happened to run)."""
    try:
        found = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return set()
    alive = set()
    for child in found:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.Error:
            continue
    return alive


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
