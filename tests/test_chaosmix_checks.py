"""bench/chaosmix.py's verdicts on what it saw (the soak itself is `make chaosmix`, outside `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from bench.chaosmix import error_ok, survivors


def test_the_documented_error_shape_passes_and_anything_else_is_named() -> None:
    good = {"error": {"message": "model 'x' is not configured", "type": "invalid_request_error", "code": "x"}}
    assert error_ok(json.dumps(good).encode()) is None
    assert error_ok(b"Internal Server Error") == "not JSON"
    assert error_ok(b'{"detail": "Not Found"}') == "not {error: {message, type, code}}"
    assert error_ok(b'{"error": {"message": "boom", "type": "x"}}') == "not {error: {message, type, code}}"
    several = {"error": {"message": "engine error: Check failed at a.hpp:784:\nInternal", "type": "t", "code": "c"}}
    assert error_ok(json.dumps(several).encode()) == "message empty or not one line"
    assert error_ok(b'{"error": {"message": "Traceback (most recent call last):", "type": "t", "code": "c"}}') \
        == "traceback in body"


def test_survivors_are_the_live_processes_seen_and_never_a_reused_pid() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        created = psutil.Process(child.pid).create_time()
        assert [line.split()[0] for line in survivors({child.pid: created})] == [str(child.pid)]
        assert survivors({child.pid: created - 100.0}) == []  # the same pid, another process: not ours
    finally:
        child.kill()
        child.wait()
    assert survivors({child.pid: created}) == []
