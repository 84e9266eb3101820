"""Counting an encoder's tokens with its tokenizer.json (modelserver/engines/counting.py): the same counts as the
OpenVINO tokenizer the pipeline uses, and that tokenizer decides every count near the limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelserver.engines.context import token_counts
from modelserver.engines.counting import CONFIRM_MARGIN, TokenCounter, load_counter, near_limit
from modelserver.engines.ov_options import COUNTING_TOKENIZER

MODELS = Path(__file__).resolve().parent.parent / "models"

TEXTS = [
    "",
    "hi",
    "A cat sits on the mat.",
    "Short sentence number 3 about football.",
    "Ünïcödé, 日本語のテキスト, emoji 🙂🚀 and tabs\tand\nnewlines",
    "numbers 3.14159 and 1,000,000 and dates 2026-12-06T04:00Z",
    "word " * 300,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]


class Exact:
    """An OpenVINO-like tokenizer stand-in: records which texts it was asked to count."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def count(self, texts: list[str]) -> list[int]:
        self.asked += texts
        return [1000 + i for i, _ in enumerate(texts)]


def fake_counter(exact: Exact, fast_counts: dict[str, int]) -> TokenCounter:
    class Fast:
        def encode(self, text: str, add_special_tokens: bool) -> Any:
            return type("E", (), {"ids": [0] * fast_counts[text]})()

    counter = TokenCounter(lambda: exact, Fast())
    return counter


def test_near_limit_marks_counts_within_the_margin_and_above() -> None:
    assert not near_limit(100, None)
    assert not near_limit(256 - CONFIRM_MARGIN - 1, 256)
    assert near_limit(256 - CONFIRM_MARGIN, 256)
    assert near_limit(300, 256)


def test_only_counts_near_the_limit_are_taken_again_by_the_exact_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    exact = Exact()
    monkeypatch.setattr("modelserver.engines.counting.token_counts",
                        lambda tokenizer, texts, special=True: tokenizer.count(list(texts)))
    counter = fake_counter(exact, {"short": 3, "long": 250, "other": 5})
    texts = ["short", "long", "other"]
    counts = counter.counts(texts)
    assert counts == [3, 250, 5] and exact.asked == []  # the fast path never builds the exact tokenizer's work
    confirmed = counter.confirmed(texts, counts, [near_limit(n, 256) for n in counts])
    assert exact.asked == ["long"]
    assert confirmed == [3, 1000, 5]


def test_without_a_tokenizer_json_the_openvino_tokenizer_counts(tmp_path: Path) -> None:
    built: list[int] = []
    counter = load_counter(tmp_path, lambda: built.append(1) or object())
    assert not counter.fast and built == [1]  # built at load: every request needs it


def test_an_unreadable_tokenizer_json_falls_back(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    counter = load_counter(tmp_path, lambda: object())
    assert not counter.fast


@pytest.mark.real_model
@pytest.mark.parametrize("folder", ["minilm-ov", "rerank-tiny-ov"])
@pytest.mark.parametrize("special", [True, False])
def test_tokenizer_json_counts_what_the_openvino_tokenizer_counts(folder: str, special: bool) -> None:
    import openvino_genai as ov_genai

    path = MODELS / folder
    if not (path / ".built").exists():
        pytest.fail(f"{path} is missing: run `make test-models` (make test does it)")
    counter = load_counter(path, lambda: ov_genai.Tokenizer(str(path), **COUNTING_TOKENIZER))
    assert counter.fast
    assert counter.counts(TEXTS, special) == token_counts(counter.exact, TEXTS, special)
