"""bench/pages.py: the resident memory of a set of processes counted once per page, and one process by mapping."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench import pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@pytest.fixture
def pair() -> Iterator[list[int]]:
    """Two idle Python processes (measured from outside: reading its own pagemap grows the reader)."""
    argv = [sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"]
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            proc.stdout.readline()  # past its start-up
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(10)


def test_one_process_union_is_its_rss(pair: list[int]) -> None:
    one = pages.union(pair[:1])
    assert one.rss_sum == pytest.approx(pages.status(pair[0]).rss, rel=0.05)
    assert one.mib == pytest.approx(one.rss_sum, rel=0.05)


def test_shared_pages_count_once(pair: list[int]) -> None:
    both = pages.union(pair)
    one = pages.union(pair[:1])
    assert both.method in ("pagemap", "pss")
    assert one.mib < both.mib < both.rss_sum  # the Python binary and libc are mapped by both


def test_breakdown_sums_to_rss_and_names_the_interpreter() -> None:
    parts = pages.breakdown(os.getpid())
    assert sum(parts.values()) == pytest.approx(pages.status(os.getpid()).rss, rel=0.05)
    assert "python binary" in parts or any(name.startswith("system library libpython") for name in parts)
    assert list(parts.values()) == sorted(parts.values(), reverse=True)


@pytest.mark.parametrize(("path", "expected"), [
    ("", "anonymous (heap, arenas, thread stacks)"),
    ("[heap]", "anonymous (heap, arenas, thread stacks)"),
    ("[stack]", "[stack]"),
    ("/v/lib/python3.11/site-packages/openvino/libs/libopenvino.so.2026.4.1", "package openvino"),
    ("/v/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_.so", "package numpy"),
    ("/usr/lib/x86_64-linux-gnu/libc.so.6", "system library libc"),
    ("/usr/local/bin/python3.11", "python binary"),
    ("/tmp/state/converted/smollm2/openvino_model.bin", "file openvino_model.bin"),
])
def test_category(path: str, expected: str) -> None:
    assert pages.category(path) == expected
