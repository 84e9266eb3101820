"""A supervisor killed with SIGKILL leaves no model process behind (PR_SET_PDEATHSIG + own process group)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only"),
]

ROOT = Path(__file__).resolve().parent.parent
SUPERVISOR = Path(__file__).resolve().parent / "procs" / "supervisor.py"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def read_pids(proc: asyncio.subprocess.Process, timeout_s: float) -> list[int]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(proc.stdout.readline(), max(deadline - time.monotonic(), 0.1))
        if not line:
            break
        if line.startswith(b"pids "):
            return [int(p) for p in line.split()[1:]]
    raise AssertionError(f"the supervisor did not report its backends (exit code {proc.returncode})")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_sigkill_of_the_supervisor_kills_its_model_processes(tmp_path: Path, loop: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    supervisor = await asyncio.create_subprocess_exec(
        sys.executable, str(SUPERVISOR), str(tmp_path / "rt"), "2", "--loop", loop,
        stdout=asyncio.subprocess.PIPE, env=env, cwd=str(ROOT),
    )  # fmt: skip
    pids: list[int] = []
    try:
        pids = await read_pids(supervisor, 40.0)
        assert len(pids) == 2 and not any(gone(pid) for pid in pids)
        assert all(psutil.Process(pid).ppid() == supervisor.pid for pid in pids)
        supervisor.send_signal(signal.SIGKILL)
        await supervisor.wait()
        deadline = time.monotonic() + 30.0  # the kernel's SIGKILL is at once; a busy machine schedules it late
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        alive = [pid for pid in pids if not gone(pid)]
        assert alive == [], f"model processes outlived their SIGKILLed supervisor by 30 s: {alive}"
    finally:
        if supervisor.returncode is None:
            supervisor.kill()
            await supervisor.wait()
        for pid in pids:  # never leave strays behind, even when the assertion failed
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
