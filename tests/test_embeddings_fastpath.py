"""The trimmed embeddings path: the count taken while the pipeline computes, vectors passed on as the pipeline
gives them, base64 packed by ``struct``. First with a stand-in pipeline (which texts reach which call), then on
the real all-MiniLM-L6-v2: answers byte for byte what the earlier path wrote, and a refused request beside an
accepted one in the same batch.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from modelserver.api.embeddings import encode_vector
from modelserver.app import build_app
from modelserver.engines.batching import DEFAULT_MAX_BATCH, BatchOptions
from modelserver.engines.counting import TokenCounter
from modelserver.engines.embeddings import OpenVINOEmbedder, load
from modelserver.errors import RequestError
from modelserver.spec import build_model_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
SPEC = build_model_spec("e", {"task": "embeddings", "engine": "fake"})


class Pipe:
    """A stand-in TextEmbeddingPipeline: each text's vector is ``[len(text)] * 3``; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.started: list[str] | None = None

    def _vectors(self, texts: list[str]) -> list[list[float]]:
        return [[float(len(text))] * 3 for text in texts]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(("embed_documents", list(texts)))
        return self._vectors(texts)

    def start_embed_documents_async(self, texts: list[str]) -> None:
        assert self.started is None, "a second call started before the first was waited for"
        self.calls.append(("start", list(texts)))
        self.started = list(texts)

    def wait_embed_documents(self) -> list[list[float]]:
        assert self.started is not None
        texts, self.started = self.started, None
        return self._vectors(texts)


class Words:
    """A stand-in ``tokenizers.Tokenizer``: one token a word, plus [CLS] and [SEP]; ``fail`` raises."""

    fail = False

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        if self.fail:
            raise RuntimeError("the tokenizer broke")
        return SimpleNamespace(ids=text.split() + (["[CLS]", "[SEP]"] if add_special_tokens else []))


def embedder(max_length: int | None, fast: Words | None = None,
             max_batch: int = DEFAULT_MAX_BATCH) -> tuple[OpenVINOEmbedder, Pipe]:
    pipe = Pipe()
    config = SimpleNamespace(max_length=max_length, normalize=True)
    counter = TokenCounter(lambda: pytest.fail("the exact tokenizer is not needed here"), fast or Words())
    return OpenVINOEmbedder(SPEC, pipe, counter, config, 0.0, BatchOptions(max_batch=max_batch)), pipe


LONG = "w " * 40  # 42 tokens with [CLS] and [SEP]


@pytest.fixture
def cut_at_100() -> Iterator[tuple[OpenVINOEmbedder, Pipe]]:
    engine, pipe = embedder(100)
    yield engine, pipe
    engine.close()


def test_with_max_length_one_call_takes_every_text_while_the_count_runs(
    cut_at_100: tuple[OpenVINOEmbedder, Pipe],
) -> None:
    engine, pipe = cut_at_100
    answers = engine._embed_all([(["a b", "c"], False), (["d e f"], True)])
    assert pipe.calls == [("start", ["a b", "c", "d e f"])]
    assert answers == [[([3.0] * 3, 4), ([1.0] * 3, 3)], [([5.0] * 3, 5)]]


def test_a_refused_job_s_vectors_are_dropped_and_the_others_keep_theirs() -> None:
    engine, pipe = embedder(20)
    engine._counter.confirmed = lambda texts, counts, near, special=True: counts  # type: ignore[method-assign]
    # (no OpenVINO tokenizer here to confirm a count near the limit: the stand-in's count stands)
    try:
        refused, accepted, cut = engine._embed_all([([LONG], False), (["a b"], False), ([LONG], True)])
    finally:
        engine.close()
    assert isinstance(refused, RequestError) and refused.code == "context_length_exceeded"
    assert accepted == [([3.0] * 3, 4)]
    assert cut == [([float(len(LONG))] * 3, 20)]  # counted as what the pipeline embedded: max_length
    assert pipe.calls == [("start", [LONG, "a b", LONG])]


def test_without_max_length_only_the_jobs_that_fit_reach_the_pipeline_after_the_count() -> None:
    engine, pipe = embedder(None)
    try:
        answers = engine._embed_all([(["a"], False), (["b c"], False)])
    finally:
        engine.close()
    assert pipe.calls == [("embed_documents", ["a", "b c"])]
    assert answers == [[([1.0] * 3, 3)], [([3.0] * 3, 4)]]


def test_a_large_request_goes_in_calls_of_at_most_max_batch_x_max_length_padded_tokens() -> None:
    """One pipeline call's memory grows with its padded tokens (and stays): a large request is cut by them."""
    engine, pipe = embedder(5, max_batch=2)  # calls of at most 2 x 5 padded tokens
    engine._counter.confirmed = lambda texts, counts, near, special=True: counts  # type: ignore[method-assign]
    texts = ["a", "b c", "d e f", "g h", "k"]  # 3, 4, 5, 4 and 3 tokens with [CLS] and [SEP]
    try:
        answers = engine._embed_all([(texts, False), (["x y"], False)])
    finally:
        engine.close()
    assert pipe.calls == [("embed_documents", ["a", "b c"]), ("embed_documents", ["d e f", "g h"]),
                          ("embed_documents", ["k", "x y"])]
    assert answers == [[([float(len(t))] * 3, len(t.split()) + 2) for t in texts], [([3.0] * 3, 4)]]


def test_short_inputs_above_max_batch_still_go_in_one_call() -> None:
    engine, pipe = embedder(100, max_batch=2)  # 6 inputs of 3-4 tokens: 24 padded tokens, under 2 x 100
    try:
        engine._embed_all([(["a", "b c", "d", "e f"], False), (["g", "h i"], False)])
    finally:
        engine.close()
    assert pipe.calls == [("embed_documents", ["a", "b c", "d", "e f", "g", "h i"])]


def test_a_count_that_fails_still_waits_for_the_started_call() -> None:
    words = Words()
    engine, pipe = embedder(100, words)
    words.fail = True
    try:
        with pytest.raises(RuntimeError, match="tokenizer broke"):
            engine._embed_all([(["a"], False)])
        words.fail = False
        assert engine._embed_all([(["b"], False)]) == [[([1.0] * 3, 3)]]  # the pipeline is free again
    finally:
        engine.close()
    assert pipe.started is None


def test_integer_vectors_are_still_written_as_floats(cut_at_100: tuple[OpenVINOEmbedder, Pipe]) -> None:
    engine, _ = cut_at_100
    rows = engine._rows([[1, 2, 3]], [4])
    assert rows == [([1.0, 2.0, 3.0], 4)] and all(type(x) is float for x in rows[0][0])


def test_struct_base64_is_numpy_s_bytes_for_awkward_numbers() -> None:
    numbers = [0.1, -0.0, 1e-45, 3.4028234663852886e38, -2.5, 1 / 3, float("nan"), float("inf"), 7]
    expected = base64.b64encode(np.asarray(numbers, dtype="<f4").tobytes()).decode("ascii")
    assert encode_vector(numbers, "base64") == expected
    assert encode_vector(numbers, "float") is numbers


# -- the real model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> Iterator[OpenVINOEmbedder]:
    folder = MODELS / "minilm-ov"
    if not (folder / ".built").exists():
        pytest.fail(f"{folder} is missing: run `make test-models` (make test does it)")
    engine = load(build_model_spec("minilm", {"task": "embeddings", "path": str(folder)}))
    yield engine
    engine.close()


TEXTS = ["A cat sits on the mat.", "Stock markets fell sharply today.", "hi", "ünïcödé 🐱 text, with punctuation!"]


def _earlier_answer(vectors: list[list[float]], encoding_format: str, tokens: int) -> bytes:
    """The answer as the path before this change wrote it: each vector copied to floats, base64 through numpy."""
    data = []
    for i, vector in enumerate(vectors):
        floats = list(map(float, vector))
        shown: Any = (base64.b64encode(np.asarray(floats, dtype="<f4").tobytes()).decode("ascii")
                      if encoding_format == "base64" else floats)
        data.append({"object": "embedding", "index": i, "embedding": shown})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return orjson.dumps({"object": "list", "data": data, "model": "minilm", "usage": usage},
                        option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.real_model
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_real_answers_are_byte_for_byte_the_earlier_path_s(minilm: OpenVINOEmbedder,
                                                                 encoding_format: str) -> None:
    app = build_app(build_model_spec("minilm", {"task": "embeddings", "path": str(MODELS / "minilm-ov")}), minilm)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://m") as client:
        answer = await client.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": encoding_format})
    assert answer.status_code == 200, answer.text
    tokens = json.loads(answer.content)["usage"]["prompt_tokens"]
    reference = minilm._pipe.embed_documents(TEXTS)  # the same texts in one call: the same numbers
    assert answer.content == _earlier_answer(reference, encoding_format, tokens)


@pytest.mark.real_model
def test_real_batch_refuses_one_job_and_answers_the_other_as_alone(minilm: OpenVINOEmbedder) -> None:
    long = "word " * 400  # > 256 tokens
    refused, accepted, cut = minilm._embed_all([([long], False), ([TEXTS[0]], False), ([long], True)])
    assert isinstance(refused, RequestError) and refused.code == "context_length_exceeded"
    assert isinstance(accepted, list) and isinstance(cut, list)
    (alone,) = minilm._pipe.embed_documents([TEXTS[0]])
    assert accepted[0][0] == pytest.approx(alone, abs=1e-4)  # batch padding leaves the vector
    assert accepted[0][1] == 9 and cut[0][1] == 256
    assert np.linalg.norm(cut[0][0]) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.real_model
def test_real_request_above_max_batch_gets_the_vectors_of_one_call(minilm: OpenVINOEmbedder) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} " * 12 + f"number {i}" for i in range(70)]  # calls of 32 x 256 tokens
    (rows,) = minilm._embed_all([(texts, False)])
    assert isinstance(rows, list) and len(rows) == 70
    whole = minilm._pipe.embed_documents(texts)
    for (vector, _), alone in zip(rows, whole, strict=True):
        assert vector == pytest.approx(list(alone), abs=1e-4)  # batch padding leaves the vector
