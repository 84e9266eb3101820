"""Every task behind the router: routing by JSON ``model`` and by the multipart ``model`` field, big uploads, 413.

The fake engines keep most of these fast; one real-model test checks MiniLM's semantic
ordering end to end (client -> router -> model server -> TextEmbeddingPipeline).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
from router_helpers import running_router, write_config
from tasks_helpers import assert_error, audio_file, image_data_url, speech_file

from tests.openai_schema import check
from tests.router_fakes import fake_router

MODELS = Path(__file__).resolve().parent.parent / "models"


def fake(task: str, **extra: Any) -> dict[str, Any]:
    return {"task": task, "engine": "fake", "fake": {"load_s": 0.05, "token_delay_s": 0.0}, **extra}


FAKES = {
    "ranker": fake("rerank"),
    "ears": fake("transcription"),
    "small-ears": fake("transcription", max_request_mb=1),
    "voice": fake("speech"),
    "eyes": fake("vlm"),
}


def wav_of_mib(mib: float) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(int(mib * 1024 * 1024 / 4), np.float32), 16_000, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


async def test_every_task_is_routed_by_its_model_name(tmp_path: Path) -> None:
    async with running_router(write_config(tmp_path, FAKES)) as router:
        client = router.client
        ranked = await client.post("/v1/rerank", json={"model": "ranker", "query": "cat", "documents": ["a cat", "x"]})
        assert ranked.status_code == 200, ranked.text
        assert ranked.json()["results"][0]["index"] == 0
        heard = await client.post("/v1/audio/transcriptions", data={"model": "ears"},
                                  files={"file": ("a.mp3", audio_file("mp3", seconds=2.0))})
        assert heard.json()["text"] == "fake transcription of 2.00 seconds of audio"
        spoken = await client.post("/v1/audio/speech", json={"model": "voice", "input": "hello", "voice": "alloy",
                                                              "response_format": "flac"})
        assert spoken.headers["content-type"] == "audio/flac"
        samples, rate = soundfile.read(io.BytesIO(spoken.content))
        assert rate == 16_000 and len(samples) == int(5 * 0.06 * 16_000)
        parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": image_data_url(20, 10)}}]
        seen = await client.post("/v1/chat/completions", json={"model": "eyes", "messages": [
            {"role": "user", "content": parts}]})
        assert seen.json()["choices"][0]["message"]["content"] == "see [image 20x10]"


async def test_a_20_mb_upload_passes_through_and_the_limit_is_a_413(tmp_path: Path) -> None:
    big = wav_of_mib(20.5)
    async with running_router(write_config(tmp_path, FAKES)) as router:
        response = await router.client.post("/v1/audio/transcriptions", data={"model": "ears"},
                                            files={"file": ("big.wav", big)})
        assert response.status_code == 200, response.text
        seconds = (len(big) - 44) // 4 / 16_000
        assert response.json()["text"] == f"fake transcription of {seconds:.2f} seconds of audio"
        refused = await router.client.post("/v1/audio/transcriptions", data={"model": "small-ears"},
                                           files={"file": ("two.wav", wav_of_mib(2))})
        assert_error(refused, 413, "limit of 1 MiB", "max_request_mb")


async def test_a_multipart_upload_for_an_unknown_model_is_404(tmp_path: Path) -> None:
    async with fake_router(tmp_path, FAKES) as router, router.client() as client:
        response = await client.post("/v1/audio/transcriptions", data={"model": "nobody"},
                                     files={"file": ("a.wav", audio_file("wav", seconds=0.5))})
        assert_error(response, 404, "ears")


@pytest.mark.real_model
async def test_minilm_semantic_order_through_the_router(tmp_path: Path) -> None:
    if not (MODELS / "minilm-ov" / ".built").exists():
        pytest.fail("models/minilm-ov is missing: run `make test-models` (make test does it)")
    minilm = {"task": "embeddings", "path": str(MODELS / "minilm-ov"), "options": {"pooling": "mean"},
              "aliases": ["text-embedding-3-small"]}
    async with running_router(write_config(tmp_path, {"minilm": minilm})) as router:
        texts = ["A cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply today."]
        response = await router.client.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": texts})
        assert response.status_code == 200, response.text
    vectors = np.array([item["embedding"] for item in response.json()["data"]])
    assert float(vectors[0] @ vectors[1]) > 0.5 > 0.2 > float(vectors[0] @ vectors[2])


#: The SDK marks ``audio.translations.create`` deprecated (OpenAI retires its endpoint in 2027); the route stays here.
SDK_DEPRECATION = pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")


@SDK_DEPRECATION
async def test_translations_through_the_sdk(tmp_path: Path) -> None:
    async with running_router(write_config(tmp_path, FAKES)) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        plain = await client.audio.translations.create(model="ears", file=("a.wav", audio_file("wav", 2.0)))
        assert plain.text == "fake transcription of 2.00 seconds of audio"
        verbose = await client.audio.translations.create(model="ears", file=("a.flac", audio_file("flac", 2.0)),
                                                         response_format="verbose_json")
        assert verbose.duration == pytest.approx(2.0) and (verbose.model_extra or {})["task"] == "translate"
        text = await client.audio.translations.create(model="ears", file=("a.mp3", audio_file("mp3", 1.0)),
                                                      response_format="text")
        assert isinstance(text, str) and text.startswith("fake transcription of")
        with pytest.raises(openai.BadRequestError, match="has task speech"):
            await client.audio.translations.create(model="voice", file=("a.wav", audio_file("wav", 1.0)))
        await client.close()


@SDK_DEPRECATION
@pytest.mark.real_model
async def test_whisper_english_only_refuses_to_translate_through_the_sdk(tmp_path: Path) -> None:
    if not (MODELS / "whisper-tiny-en-ov" / ".built").exists():
        pytest.fail("models/whisper-tiny-en-ov is missing: run `make test-models` (make test does it)")
    whisper = {"task": "transcription", "path": str(MODELS / "whisper-tiny-en-ov"), "options": {"max_new_tokens": 48}}
    async with running_router(write_config(tmp_path, {"whisper": whisper})) as router:
        client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=180)
        with pytest.raises(openai.BadRequestError, match="English-only: it cannot translate") as refused:
            await client.audio.translations.create(model="whisper", file=("s.flac", speech_file("flac")))
        assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "model"
        heard = await client.audio.transcriptions.create(model="whisper", file=("s.flac", speech_file("flac")))
        assert "bananas" in heard.text.lower(), "the same process keeps transcribing"
        raw = await client.audio.transcriptions.with_raw_response.create(  # word timings without any option
            model="whisper", file=("s.flac", speech_file("flac")), response_format="verbose_json",
            timestamp_granularities=["word", "segment"])
        check(json.loads(raw.text), "CreateTranscriptionResponseVerboseJson")
        words = [w.word.lower().strip(",.") for w in raw.parse().words or []]
        assert "john" in words and "bananas" in words, words
        stream = await client.audio.transcriptions.create(model="whisper", file=("s.flac", speech_file("flac")),
                                                          stream=True)
        events = [event async for event in stream]  # deltas as Whisper decodes, through the router, then the text
        for event in events:
            check(event.model_dump(mode="json", exclude_unset=True), "CreateTranscriptionResponseStreamEvent")
        deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
        assert len(deltas) > 3 and [e.type for e in events[len(deltas):]] == ["transcript.text.done"]
        assert "".join(deltas).strip() == events[-1].text and "bananas" in events[-1].text.lower()
        await client.close()
