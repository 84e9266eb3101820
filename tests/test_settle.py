"""After the first answer the model server drops the pages of read-only shared file mappings (modelserver/settle.py)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path
from typing import Any

import pytest

from modelserver.settle import MADV_DONTNEED, Settle, read_only_file_mappings, release_file_pages

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 123 /usr/bin/python3.11
7f0000000000-7f0000100000 r--s 00000000 08:01 456 /models/smol/openvino_model.bin
7f0000100000-7f0000200000 rw-s 00000000 08:01 457 /dev/shm/shared
7f0000200000-7f0000300000 r--p 00000000 08:01 458 /usr/lib/libopenvino.so.2641
7f0000300000-7f0000400000 r--s 00000000 00:00 0
7f0000400000-7f0000500000 r-xp 00000000 08:01 459 /usr/lib/libc.so.6
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def test_only_read_only_shared_file_mappings_are_released() -> None:
    assert list(read_only_file_mappings(MAPS)) == [
        (0x7F0000000000, 0x7F0000100000, "/models/smol/openvino_model.bin")
    ]


def test_release_advises_each_of_them_and_counts_the_bytes(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    calls: list[tuple[int, int, int]] = []
    released = release_file_pages(maps, lambda start, length, advice: calls.append((start, length, advice)) or 0)
    assert calls == [(0x7F0000000000, 0x100000, MADV_DONTNEED)]
    assert released == 0x100000
    assert release_file_pages(tmp_path / "missing", lambda *_: 0) == 0


def test_settle_runs_once() -> None:
    runs: list[str] = []
    settle = Settle("m", release=lambda: runs.append("release") or 0, trim=lambda: runs.append("trim") or True)
    settle.after_answer()
    settle.after_answer()
    assert runs == ["release", "trim"] and settle.done


def _resident_kib(path: Path) -> int:
    """This process's resident KiB of its mappings of ``path`` (``/proc/self/smaps``)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise through /proc/self/maps: Linux")
def test_a_released_mapping_reads_back_the_same_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * (4096 * 4)  # 4 MiB
    weights = tmp_path / "weights.bin"
    weights.write_bytes(data)
    with weights.open("rb") as file:
        view = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        try:
            assert view[:] == data  # every page read: resident in this process
            assert _resident_kib(weights) >= len(data) // 1024
            released = release_file_pages()
            assert released >= len(data)
            assert _resident_kib(weights) == 0
            assert view[:] == data  # faulted back in from the file, unchanged
        finally:
            view.close()


async def _answer(app: Any, path: str) -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app({"type": "http", "path": path, "method": "POST", "headers": []}, receive, send)


async def test_the_app_settles_after_its_first_model_answer_only() -> None:
    from modelserver.app import ExitWhenFailed
    from modelserver.runtime import ModelRuntime
    from modelserver.spec import build_model_spec

    statuses = {"/health": 200, "/v1/bad": 400, "/v1/embeddings": 200}

    async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": statuses[scope["path"]], "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    runtime = ModelRuntime(build_model_spec("m", {"task": "embeddings", "engine": "fake"}))
    runtime.set_ready(object())
    runs: list[int] = []
    settle = Settle("m", release=lambda: runs.append(1) or 0, trim=lambda: True)
    app = ExitWhenFailed(inner, runtime, settle)
    await _answer(app, "/health")
    await _answer(app, "/v1/bad")
    assert runs == []  # no model answer yet: its first inference (the weights' copy) is still ahead
    await _answer(app, "/v1/embeddings")
    await _answer(app, "/v1/embeddings")
    assert runs == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_the_c_library_is_found_without_a_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """find_library("c") runs ``ldconfig -p`` in a fork of the model server, right after its first answer."""
    import ctypes.util
    import subprocess

    from modelserver import settle

    def no_child(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a child process was started")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    monkeypatch.setattr(ctypes.util, "find_library", no_child)
    settle._libc.cache_clear()
    try:
        libc = settle._libc()
        assert libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "madvise")
        assert settle._libc() is libc  # once per process
        assert settle.trim_heap() is True
    finally:
        settle._libc.cache_clear()
