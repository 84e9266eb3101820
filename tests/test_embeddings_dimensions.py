"""``dimensions`` on ``/v1/embeddings``: a Matryoshka-trained model (``options.matryoshka``, or its
model card's ``loss:MatryoshkaLoss`` tag) answers each vector's first N numbers, renormalized; any other
model a 400 naming ``dimensions``. The fake engine in process, then the real MiniLM through the SDK."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from modelserver.app import build_app
from modelserver.engines.fake import FakeEmbedder
from modelserver.engines.st_metadata import declared_options
from modelserver.spec import build_model_spec

MODELS = Path(__file__).resolve().parent.parent / "models"
TEXTS = ["A cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply today."]


def sdk(app: Any) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(base_url="http://m/v1", api_key="x", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://m"))


@pytest.fixture
async def fake_matryoshka() -> AsyncIterator[openai.AsyncOpenAI]:
    spec = build_model_spec("m", {"task": "embeddings", "engine": "fake", "options": {"matryoshka": True},
                                  "fake": {"dims": 64, "token_delay_s": 0, "load_s": 0}})
    async with sdk(build_app(spec, FakeEmbedder(spec))) as client:
        yield client


def assert_prefixes(full: list[list[float]], short: list[list[float]], size: int) -> None:
    """Each short vector is its full one's first ``size`` numbers, scaled to length 1."""
    whole, cut = np.asarray(full), np.asarray(short)
    assert cut.shape == (len(full), size)
    assert np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
    prefix = whole[:, :size] / np.linalg.norm(whole[:, :size], axis=1, keepdims=True)
    assert np.allclose(cut, prefix, atol=1e-5)


async def test_a_matryoshka_model_answers_the_first_n_numbers_renormalized(
        fake_matryoshka: openai.AsyncOpenAI) -> None:
    full = await fake_matryoshka.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    short = await fake_matryoshka.embeddings.create(model="m", input=TEXTS, dimensions=16)  # the SDK asks base64
    assert_prefixes([d.embedding for d in full.data], [d.embedding for d in short.data], 16)
    assert short.usage.prompt_tokens == full.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="dimensions: this model's vectors have 64 numbers"):
        await fake_matryoshka.embeddings.create(model="m", input="x", dimensions=65)


async def test_another_model_refuses_dimensions_naming_it() -> None:
    spec = build_model_spec("m", {"task": "embeddings", "engine": "fake", "fake": {"token_delay_s": 0}})
    async with sdk(build_app(spec, FakeEmbedder(spec))) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model="m", input="x", dimensions=8)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "dimensions" and "Matryoshka" in error["message"]


def test_a_model_card_tagged_with_a_matryoshka_loss_declares_it(tmp_path: Path) -> None:
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "", "type": "x.Transformer"}]))
    assert "matryoshka" not in declared_options(tmp_path, {})
    (tmp_path / "README.md").write_text("---\nlanguage: en\ntags:\n- sentence-transformers\n- loss:MatryoshkaLoss\n"
                                        "- loss:MultipleNegativesRankingLoss\n---\n# A model\n")
    assert declared_options(tmp_path, {})["matryoshka"] is True
    (tmp_path / "README.md").write_text("---\ntags: [sentence-transformers]\n---\nMatryoshka in prose only\n")
    assert "matryoshka" not in declared_options(tmp_path, {})


@pytest.mark.real_model
async def test_minilm_flagged_matryoshka_shortens_its_real_vectors(tmp_path: Path) -> None:
    from modelserver.engines import embeddings

    if not (MODELS / "minilm-ov" / ".built").exists():
        pytest.fail(f"{MODELS / 'minilm-ov'} is missing: run `make test-models` (make test does it)")
    spec = build_model_spec("minilm", {"task": "embeddings", "path": str(MODELS / "minilm-ov"),
                                       "cache_dir": str(tmp_path), "options": {"matryoshka": True}})
    engine = embeddings.load(spec)
    try:
        async with sdk(build_app(spec, engine)) as client:
            full = await client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
            short = await client.embeddings.create(model="minilm", input=TEXTS, dimensions=128)
    finally:
        engine.close()
    assert len(full.data[0].embedding) == 384
    assert_prefixes([d.embedding for d in full.data], [d.embedding for d in short.data], 128)
