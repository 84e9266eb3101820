"""A rerank request's documents are scored in pipeline calls of at most ``max_batch`` x ``max_length`` padded
tokens (one call's memory grows with its documents, and the CPU plugin keeps it), the rankings merged:
first with a stand-in pipeline (which documents reach which call, the merged order and indices), then on the
real tiny reranker (the same ranking as one call)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from modelserver.engines.batching import Abandoned, BatchOptions, Inputs
from modelserver.engines.counting import TokenCounter
from modelserver.engines.media_base import RerankResult
from modelserver.engines.rerank import OpenVINOReranker, load
from modelserver.spec import build_model_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
SPEC = build_model_spec("r", {"task": "rerank", "engine": "fake"})


class Words:
    """A stand-in ``tokenizers.Tokenizer``: one token a word, plus [CLS] and [SEP]."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        return SimpleNamespace(ids=text.split() + (["[CLS]", "[SEP]"] if add_special_tokens else []))


class Pipe:
    """A stand-in TextRerankPipeline: a document's score is its length; records the documents of every call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def rerank(self, query: str, documents: list[str]) -> list[tuple[int, float]]:
        self.calls.append(list(documents))
        return sorted(enumerate(float(len(d)) for d in documents), key=lambda pair: -pair[1])


def test_documents_go_in_calls_of_at_most_max_batch_x_max_length_tokens_and_the_rankings_merge() -> None:
    pipe = Pipe()
    counter = TokenCounter(lambda: pytest.fail("the exact tokenizer is not needed here"), Words())
    counter.confirmed = lambda texts, counts, near, special=True: counts  # type: ignore[method-assign]
    engine = OpenVINOReranker(SPEC, pipe, counter, 0.0, BatchOptions(max_batch=2), max_length=6)
    documents = ["bb", "a", "eeeee", "dddd", "ccc"]  # each pair 5 tokens: calls of two (at most 2 x 6 tokens)
    try:
        (result,) = engine._rerank_all([("q", documents, False)])
    finally:
        engine.close()
    assert pipe.calls == [["bb", "a"], ["eeeee", "dddd"], ["ccc"]]
    assert isinstance(result, RerankResult)
    assert result.ranking == [(2, 5.0), (3, 4.0), (4, 3.0), (0, 2.0), (1, 1.0)]
    assert result.prompt_tokens == 1 * 5 + 5


@pytest.mark.real_model
def test_real_request_above_max_batch_ranks_as_one_call() -> None:
    folder = MODELS / "rerank-tiny-ov"
    if not (folder / ".built").exists():
        pytest.fail(f"{folder} is missing: run `make test-models` (make test does it)")
    engine = load(build_model_spec("rerank", {"task": "rerank", "path": str(folder)}))
    documents = [f"document {i} about {'cats' if i % 3 else 'markets'} and mats " * 20 for i in range(70)]
    try:
        (result,) = engine._rerank_all([("cat on a mat", documents, False)])  # calls of 32 x 512 tokens
        whole = [(int(i), float(s)) for i, s in engine._pipe.rerank("cat on a mat", documents)]
    finally:
        engine.close()
    assert isinstance(result, RerankResult)
    assert sorted(i for i, _ in result.ranking) == list(range(70))
    scores = dict(whole)
    for index, score in result.ranking:
        assert score == pytest.approx(scores[index], abs=1e-4)  # batch padding leaves the score
    assert [s for _, s in result.ranking] == sorted((s for _, s in result.ranking), reverse=True)


def test_a_gone_request_s_remaining_calls_are_skipped_and_the_others_are_scored() -> None:
    pipe = Pipe()
    counter = TokenCounter(lambda: pytest.fail("the exact tokenizer is not needed here"), Words())
    counter.confirmed = lambda texts, counts, near, special=True: counts  # type: ignore[method-assign]
    engine = OpenVINOReranker(SPEC, pipe, counter, 0.0, BatchOptions(max_batch=2), max_length=6)
    left, stays = Inputs(["a", "bb", "ccc", "dddd"]), Inputs(["x", "yy", "zzz"])
    rerank = pipe.rerank

    def leaving(query: str, documents: list[str]) -> list[tuple[int, float]]:
        left.gone = True  # its client leaves while the first call runs
        return rerank(query, documents)

    pipe.rerank = leaving  # type: ignore[method-assign]
    try:
        gone, kept = engine._rerank_all([("q", left, False), ("q", stays, False)])
    finally:
        engine.close()
    assert isinstance(gone, Abandoned)
    assert isinstance(kept, RerankResult) and kept.ranking == [(2, 3.0), (1, 2.0), (0, 1.0)]
    assert pipe.calls == [["a", "bb"], ["x", "yy"], ["zzz"]]
