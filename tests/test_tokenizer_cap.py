"""The tokenizer's cut is probed once per tokenizer and kept in cache_dir (modelserver/engines/context.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from modelserver.engines.context import CAP_FILE, PromptCounter, remembered_cap, tokenizer_files, truncation_cap


def _cutting_at(cap: int, probes: list[str]) -> Callable[[str], int]:
    def count(text: str) -> int:
        probes.append(text)
        return min(len(text.split()), cap)
    return count


def test_the_probe_runs_once_per_tokenizer_and_version(tmp_path: Path) -> None:
    tokenizer = tmp_path / "model.gguf"
    tokenizer.write_bytes(b"one")
    cache = tmp_path / "cache"
    probes: list[str] = []
    count = _cutting_at(8192, probes)
    assert remembered_cap(count, str(cache), [tokenizer], "v1") == 8192 == truncation_cap(count)
    probed = len(probes)
    assert remembered_cap(count, str(cache), [tokenizer], "v1") == 8192
    assert len(probes) == probed  # read back, not probed
    assert json.loads((cache / CAP_FILE).read_text()) and not list(cache.glob("*.part"))
    remembered_cap(count, str(cache), [tokenizer], "v2")
    assert len(probes) > probed  # another openvino_genai: probed again
    probed = len(probes)
    tokenizer.write_bytes(b"changed")  # another tokenizer at the same path
    os.utime(tokenizer, ns=(1, 1))
    remembered_cap(count, str(cache), [tokenizer], "v2")
    assert len(probes) > probed


def test_a_tokenizer_that_cuts_nothing_is_remembered_as_none(tmp_path: Path) -> None:
    tokenizer = tmp_path / "openvino_tokenizer.xml"
    tokenizer.write_text("<net/>")
    probes: list[str] = []

    def count(text: str) -> int:
        probes.append(text)
        return len(text.split())

    assert remembered_cap(count, str(tmp_path), [tokenizer], "v") is None
    probed = len(probes)
    assert remembered_cap(count, str(tmp_path), [tokenizer], "v") is None and len(probes) == probed


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"KEY": "a string"}'])
def test_a_damaged_file_means_a_probe(tmp_path: Path, content: str) -> None:
    tokenizer = tmp_path / "t.gguf"
    tokenizer.write_bytes(b"x")
    (tmp_path / CAP_FILE).write_text(content)
    probes: list[str] = []
    assert remembered_cap(_cutting_at(100, probes), str(tmp_path), [tokenizer], "v") == 100
    assert probes


def test_no_cache_dir_or_no_files_probes_every_time(tmp_path: Path) -> None:
    probes: list[str] = []
    count = _cutting_at(100, probes)
    for cache, files in ((None, [tmp_path]), (str(tmp_path), [])):
        before = len(probes)
        assert remembered_cap(count, cache, files, "v") == 100
        assert len(probes) > before
    assert not (tmp_path / CAP_FILE).exists()


def test_a_folder_that_cannot_be_written_still_answers(tmp_path: Path) -> None:
    tokenizer = tmp_path / "t.gguf"
    tokenizer.write_bytes(b"x")
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    assert remembered_cap(_cutting_at(100, []), str(blocked), [tokenizer], "v") == 100


def test_the_files_of_a_tokenizer(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    assert tokenizer_files(gguf) == [gguf]
    assert tokenizer_files(tmp_path) == []
    (tmp_path / "openvino_tokenizer.xml").write_text("")
    (tmp_path / "openvino_tokenizer.bin").write_bytes(b"")
    assert tokenizer_files(tmp_path) == [tmp_path / "openvino_tokenizer.xml", tmp_path / "openvino_tokenizer.bin"]


def test_the_real_gguf_tokenizer_remembers_its_8192(demo_gguf: Path, tmp_path: Path) -> None:
    import openvino_genai as ov_genai

    tokenizer = ov_genai.Tokenizer(str(demo_gguf))
    first = PromptCounter(tokenizer, 4_000_000, lambda count: remembered_cap(count, str(tmp_path), [demo_gguf], "v"))
    assert first.cap == 8192 == first.context_length

    def no_probe(count: Callable[[str], int]) -> int | None:
        return remembered_cap(lambda _text: pytest.fail("probed again"), str(tmp_path), [demo_gguf], "v")

    assert PromptCounter(tokenizer, 4_000_000, no_probe).cap == 8192
