"""A crash of a router or model-server process started by the suite leaves its Python traceback of every thread
under the run's crash folder (tests/conftest.py sets ``OVROUTER_FAULT_DIR``; docs/robustness.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CRASH = "import faulthandler; faulthandler._sigsegv()"


@pytest.mark.parametrize("role, enable", [("modelserver", "from modelserver import startup; startup.fault_log()"),
                                          ("router", "from router.cli import _fault_log; _fault_log()")])
def test_a_segfault_leaves_every_threads_traceback_in_the_fault_folder(tmp_path: Path, role: str, enable: str) -> None:
    env = {**os.environ, "OVROUTER_FAULT_DIR": str(tmp_path / "faults"), "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-c", f"{enable}; {CRASH}"], env=env, cwd=tmp_path, timeout=60,
                          capture_output=True)
    assert proc.returncode == -signal.SIGSEGV, proc
    (dump,) = (tmp_path / "faults").glob(f"{role}-*.txt")
    text = dump.read_text()
    assert "Fatal Python error: Segmentation fault" in text and "most recent call first" in text, text


def test_the_suite_sets_the_fault_folder_for_every_process_it_starts() -> None:
    assert os.environ["PYTHONFAULTHANDLER"] and "crashes" in os.environ["OVROUTER_FAULT_DIR"]
