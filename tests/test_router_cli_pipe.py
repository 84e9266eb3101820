"""The CLI when its reader goes away (``ovrouter status --json | head``): no BrokenPipe traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router_helpers import fake_model, write_config

pytestmark = pytest.mark.timeout(60)


def test_a_closed_stdout_pipe_is_no_traceback(tmp_path: Path) -> None:
    config = write_config(tmp_path, {f"m{i}": fake_model() for i in range(3)})
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the CLI writes a byte: every write is EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "router.cli", "check", str(config)],
                              stdout=write, stderr=subprocess.PIPE, timeout=30, check=False)
    finally:
        os.close(write)
    assert b"BrokenPipeError" not in done.stderr and b"Traceback" not in done.stderr, done.stderr.decode()
    assert done.returncode == 1
