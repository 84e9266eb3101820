"""The real openvino_genai pipelines of every non-LLM task, through a running ``python -m modelserver``.

The models come from ``make test-models`` (tools/build_test_models.py): all-MiniLM-L6-v2
and whisper tiny.en with their real weights, so MiniLM's semantic ordering and Whisper's
transcript of real (espeak-ng) speech are asserted; the others are tiny random-weight
models of the real architectures, so their tests assert shapes, formats and plumbing.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
from modelserver_helpers import ModelServerProcess, modelserver
from tasks_helpers import assert_error, audio_file, image_data_url, speech_file, sse_events

from modelserver.engines.media_base import RerankResult
from modelserver.spec import build_model_spec
from tests.openai_schema import check

pytestmark = pytest.mark.real_model

MODELS = Path(__file__).resolve().parent.parent / "models"


def model_path(name: str) -> str:
    path = MODELS / name
    if not (path / ".built").exists():
        pytest.fail(f"{path} is missing: run `make test-models` (make test does it)")
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ov-cache")


def serve(name: str, task: str, folder: str, cache: Path, **settings: Any) -> Any:
    """A real model server of ``folder`` (a module-scoped fixture enters it, so the leak check sees it as set-up)."""
    raw = {"task": task, "path": model_path(folder), "cache_dir": str(cache), **settings}
    return modelserver(spec=build_model_spec(name, raw), ready_timeout_s=180)


# -- embeddings ---------------------------------------------------------------------------------

CAT, KITTEN, STOCKS = "A cat sits on the mat.", "A kitten is resting on a rug.", "Stock markets fell sharply today."


@pytest.fixture(scope="module")
def minilm(cache_dir: Path) -> Iterator[ModelServerProcess]:
    with serve("minilm", "embeddings", "minilm-ov", cache_dir) as server:  # options from its sentence-transformers
        yield server


def test_minilm_options_come_from_its_sentence_transformers_files(minilm: ModelServerProcess) -> None:
    loaded = minilm.wait_log("loaded minilm")
    assert "pooling=mean normalize=True max_length=256" in loaded  # modules.json, 1_Pooling, sentence_bert_config


def test_minilm_ranks_by_meaning_through_the_openai_sdk(minilm: ModelServerProcess) -> None:
    client = openai.OpenAI(base_url=minilm.base_url + "/v1", api_key="unused", max_retries=0)
    result = client.embeddings.create(model="minilm", input=[CAT, KITTEN, STOCKS])  # the SDK asks for base64
    vectors = np.array([item.embedding for item in result.data])
    assert vectors.shape == (3, 384)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx(1.0, abs=1e-4)
    similar, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert similar > 0.5 > 0.2 > unrelated  # 0.66 and 0.05 for the real all-MiniLM-L6-v2


def test_minilm_refuses_dimensions_it_was_not_trained_for(minilm: ModelServerProcess) -> None:
    client = openai.OpenAI(base_url=minilm.base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="dimensions") as refused:
        client.embeddings.create(model="minilm", input=CAT, dimensions=128)
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "dimensions"


def test_minilm_float_and_base64_agree_and_usage_counts_real_tokens(minilm: ModelServerProcess) -> None:
    with minilm.client() as client:
        floats = client.post("/v1/embeddings", json={"input": [CAT, "hi"], "encoding_format": "float"}).json()
        packed = client.post("/v1/embeddings", json={"input": [CAT, "hi"], "encoding_format": "base64"}).json()
        single = client.post("/v1/embeddings", json={"input": "hi"}).json()
    for f, b in zip(floats["data"], packed["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded == pytest.approx(np.array(f["embedding"]), abs=1e-6)
    assert single["usage"]["prompt_tokens"] == 3  # [CLS] hi [SEP]
    assert floats["usage"]["prompt_tokens"] == 9 + 3  # [CLS] a cat sits on the mat . [SEP]
    assert single["data"][0]["embedding"] == pytest.approx(floats["data"][1]["embedding"], abs=1e-5)


def test_minilm_load_used_the_cache_dir(minilm: ModelServerProcess, cache_dir: Path) -> None:
    assert any(cache_dir.iterdir()), "OpenVINO wrote no compiled-model cache into CACHE_DIR"


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"options": {"pooling": "median"}}, "options.pooling: expected one of cls, mean, last_token"),
        ({"options": {"poolin": "mean"}}, "options.poolin: unknown option for task embeddings"),
        ({"options": {"normalize": "yes"}}, "options.normalize: expected true or false"),
        ({"path": str(MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf")}, "is not a folder"),
    ],
)
def test_bad_embeddings_settings_fail_the_load_naming_the_key(settings: dict[str, Any], needle: str) -> None:
    raw = {"task": "embeddings", "path": model_path("minilm-ov"), **settings}
    with modelserver(spec=build_model_spec("bad", raw), wait=False) as server:
        assert server.wait_exit(60) == 1
        assert needle in server.log_text()


async def test_minilm_concurrent_requests_share_pipeline_calls_and_keep_their_own_vectors(
    minilm: ModelServerProcess,
) -> None:
    texts = [f"Sentence {i}: {topic}." for i, topic in enumerate([CAT, KITTEN, STOCKS, "hi"] * 4)]
    calls: list[int] = []
    async with minilm.async_client() as client:
        alone = [(await client.post("/v1/embeddings", json={"input": text})).json() for text in texts[:4]]
        # Whether 16 requests sent at once overlap in the server depends on the client's and the machine's
        # timing (about 1 round in 8 arrives one by one, on this commit and before it): up to 5 rounds, each
        # checked in full, until one of them shared a pipeline call.
        for _ in range(5):
            before = (await client.get("/health")).json()
            answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"input": text}) for text in texts))
            after = (await client.get("/health")).json()
            bodies = [answer.json() for answer in answers]
            for body, reference in zip(bodies[:4], alone, strict=True):  # padding in a batch leaves each vector
                assert body["data"][0]["embedding"] == pytest.approx(reference["data"][0]["embedding"], abs=1e-4)
                assert body["usage"] == reference["usage"]
            assert all(len(body["data"]) == 1 and body["data"][0]["index"] == 0 for body in bodies)
            calls.append(after["completed"] - before["completed"])
            if calls[-1] < len(texts):
                break
    assert min(calls) < len(texts), f"pipeline calls per round of {len(texts)} concurrent requests: {calls}"
    assert after["largest_batch"] > 1


def test_minilm_batch_is_one_pipeline_call(minilm: ModelServerProcess) -> None:
    with minilm.client() as client:
        before = client.get("/health").json()["completed"]
        texts = [f"sentence number {i} about cats" for i in range(16)]
        body = client.post("/v1/embeddings", json={"input": texts}).json()
        after = client.get("/health").json()["completed"]
    assert [item["index"] for item in body["data"]] == list(range(16))
    assert after - before == 1


# -- rerank -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker(cache_dir: Path) -> Iterator[ModelServerProcess]:
    with serve("rerank", "rerank", "rerank-tiny-ov", cache_dir) as server:
        yield server


def test_rerank_scores_every_document_and_counts_tokens(reranker: ModelServerProcess) -> None:
    server = reranker
    documents = ["a cat", "stock markets fell", "dogs bark loudly at night", "the mat"]
    with server.client() as client:
        full = client.post("/v1/rerank", json={"query": "cat on a mat", "documents": documents}).json()
        top = client.post("/v1/rerank", json={"query": "cat on a mat", "documents": documents, "top_n": 2,
                                              "return_documents": True}).json()
    scores = [r["relevance_score"] for r in full["results"]]
    assert sorted(r["index"] for r in full["results"]) == [0, 1, 2, 3]
    assert scores == sorted(scores, reverse=True) and all(0.0 < s < 1.0 for s in scores)
    assert top["results"] == [{**r, "document": {"text": documents[r["index"]]}} for r in full["results"][:2]]
    assert full["usage"]["prompt_tokens"] == 4 * 4 + (2 + 3 + 5 + 2)  # the query per document, then each document


def test_a_rerank_batch_gives_each_request_what_it_gets_alone() -> None:
    from modelserver.engines.rerank import load

    engine = load(build_model_spec("rerank", {"task": "rerank", "path": model_path("rerank-tiny-ov")}))
    try:
        docs = [["a cat", "the mat"], ["stock markets fell", "a cat", "dogs bark"], ["the mat"]]
        jobs = [(query, documents, False) for query in ("cat on a mat", "markets") for documents in docs]
        together = engine._rerank_all(jobs)  # what the batcher calls for requests that met
        for job, result in zip(jobs, together, strict=True):
            (alone,) = engine._rerank_all([job])
            assert isinstance(result, RerankResult) and isinstance(alone, RerankResult)
            assert [index for index, _ in result.ranking] == [index for index, _ in alone.ranking]
            assert [score for _, score in result.ranking] == pytest.approx([score for _, score in alone.ranking],
                                                                           abs=1e-4)
            assert result.prompt_tokens == alone.prompt_tokens
    finally:
        engine.close()


# -- transcription ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper(cache_dir: Path) -> Iterator[ModelServerProcess]:
    options = {"max_new_tokens": 96, "word_timestamps": True}
    with serve("whisper", "transcription", "whisper-tiny-en-ov", cache_dir, options=options) as server:
        yield server


def transcribe(server: ModelServerProcess, data: bytes, **fields: Any) -> Any:
    with server.client() as client:
        return client.post("/v1/audio/transcriptions", files={"file": ("audio", data)}, data={"model": "w", **fields})


def heard(text: str) -> str:
    return " ".join(text.lower().replace(",", " ").replace(".", " ").split())


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3"])
def test_whisper_transcribes_real_speech_in_every_format(whisper: ModelServerProcess, fmt: str) -> None:
    # espeak-ng saying "Hello, my name is John. I like to eat apples and bananas." at 22.05 kHz
    response = transcribe(whisper, speech_file(fmt))
    assert response.status_code == 200, response.text
    text = heard(response.json()["text"])
    assert "my name is john" in text and "bananas" in text, text


def test_whisper_verbose_json_with_segments_and_words(whisper: ModelServerProcess) -> None:
    fields = {"response_format": "verbose_json", "timestamp_granularities[]": ["segment", "word"]}
    body = transcribe(whisper, speech_file("flac"), **fields).json()
    check(body, "CreateTranscriptionResponseVerboseJson")  # every segment field the spec requires
    assert body["language"] == "en" and body["duration"] == pytest.approx(5.72, abs=0.01)  # 4.72 s + 1 s of silence
    assert body["segments"] and all(0 <= s["start"] <= s["end"] <= 6.0 for s in body["segments"])
    words = [heard(w["word"]) for w in body["words"]]
    assert "john" in words and "bananas" in words, words
    starts = [w["start"] for w in body["words"]]
    assert starts == sorted(starts) and all(w["start"] <= w["end"] for w in body["words"])


def test_whisper_long_audio_spans_windows_and_subtitles(whisper: ModelServerProcess) -> None:
    # the sentence 8 times with a second of silence between: 46 s, two 30-second windows
    srt = transcribe(whisper, speech_file("flac", repeat=8), response_format="srt")
    assert srt.status_code == 200, srt.text
    cues = [cue.split("\n") for cue in srt.text.strip().split("\n\n")]
    assert len(cues) >= 2 and cues[0][0] == "1" and " --> " in cues[0][1]
    assert "00:00:30,000" < cues[-1][1].split(" --> ")[1] <= "00:00:46,720"  # the second window's, within the audio
    assert heard(srt.text).count("bananas") >= 6


def test_whisper_rejects_what_the_model_cannot_do(whisper: ModelServerProcess) -> None:
    assert_error(transcribe(whisper, audio_file("wav"), language="de"), 400, "English-only")
    with whisper.client() as client:
        translated = client.post("/v1/audio/translations", files={"file": ("a", audio_file("wav"))})
    assert_error(translated, 400, "cannot translate")
    assert_error(transcribe(whisper, b"RIFF0000WAVEnot really"), 400, "could not decode")


# -- speech -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speecht5(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModelServerProcess]:
    voice = tmp_path_factory.mktemp("voices") / "anna.npy"
    np.save(voice, np.random.default_rng(7).standard_normal((1, 512)).astype(np.float32) * 0.1)
    options = {"minlenratio": 1.0, "voices": {"anna": str(voice)}}
    with serve("speecht5", "speech", "speecht5-tiny-ov", cache_dir, options=options) as server:
        yield server


def speak(server: ModelServerProcess, **body: Any) -> Any:
    with server.client() as client:
        return client.post("/v1/audio/speech", json={"model": "t", "voice": "anna", **body})


def test_speecht5_speaks_wav_and_longer_text_is_longer(speecht5: ModelServerProcess) -> None:
    short = speak(speecht5, input="Hello.", response_format="wav")
    long = speak(speecht5, input="Hello there. This sentence is a good deal longer than that one.",
                 response_format="wav")
    assert short.status_code == 200, short.text
    short_samples, rate = soundfile.read(io.BytesIO(short.content))
    long_samples, _ = soundfile.read(io.BytesIO(long.content))
    assert rate == 16_000 and short.headers["content-type"] == "audio/wav"
    assert 0 < len(short_samples) < len(long_samples)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
def test_speecht5_compressed_formats_decode(speecht5: ModelServerProcess, fmt: str) -> None:
    response = speak(speecht5, input="Testing the formats.", response_format=fmt)
    assert response.status_code == 200, response.text
    samples, _ = soundfile.read(io.BytesIO(response.content))
    assert len(samples) > 0


def test_speecht5_refuses_speed_and_unknown_voices(speecht5: ModelServerProcess) -> None:
    assert_error(speak(speecht5, input="hi", speed=1.5), 400, "one speed")
    assert_error(speak(speecht5, input="hi", voice="alloy"), 400, "known: anna")


# -- vlm ----------------------------------------------------------------------------------------


def vision(parts: list[Any], **params: Any) -> dict[str, Any]:
    return {"model": "llava", "messages": [{"role": "user", "content": parts}], "temperature": 0, **params}


NO_EOS = {"ignore_eos": True}  # random weights: where an exact length is tested, no CPU's EOS may cut it


IMAGE = {"type": "image_url", "image_url": {"url": image_data_url(64, 48)}}
ASK = {"type": "text", "text": "What is in the image?"}


@pytest.fixture(scope="module")
def llava(cache_dir: Path) -> Iterator[ModelServerProcess]:
    with serve("llava", "vlm", "llava-tiny-ov", cache_dir, default_max_tokens=8) as server:
        yield server


def test_llava_images_reach_the_vision_encoder(llava: ModelServerProcess) -> None:
    with llava.client() as client:
        text_only = client.post("/v1/chat/completions", json=vision([ASK])).json()
        one = client.post("/v1/chat/completions", json=vision([ASK, IMAGE])).json()
        two = client.post("/v1/chat/completions", json=vision([IMAGE, ASK, IMAGE])).json()
    # each image adds its 16 patch embeddings (and a newline) to the prompt
    assert one["usage"]["prompt_tokens"] >= text_only["usage"]["prompt_tokens"] + 16
    assert two["usage"]["prompt_tokens"] >= one["usage"]["prompt_tokens"] + 16
    assert one["choices"][0]["finish_reason"] in ("stop", "length")
    assert one["usage"]["completion_tokens"] <= 8


def test_llava_stream_matches_the_whole_answer(llava: ModelServerProcess) -> None:
    with llava.client() as client:
        whole = client.post("/v1/chat/completions", json=vision([ASK, IMAGE], max_tokens=6, **NO_EOS)).json()
        streamed = client.post("/v1/chat/completions", json=vision([ASK, IMAGE], max_tokens=6, stream=True, **NO_EOS,
                                                                    stream_options={"include_usage": True}))
    events = sse_events(streamed.text)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-1]["usage"] == whole["usage"] and whole["usage"]["completion_tokens"] == 6
    assert whole["choices"][0]["finish_reason"] == "length"


def test_llava_takes_an_input_image_on_the_responses_api(llava: ModelServerProcess) -> None:
    ask = {"type": "input_text", "text": ASK["text"]}
    image = {"type": "input_image", "image_url": IMAGE["image_url"]["url"]}  # type: ignore[index]
    with llava.client() as client:
        text_only = client.post("/v1/responses", json={"input": [{"role": "user", "content": [ask]}]}).json()
        seen = client.post("/v1/responses", json={"input": [{"role": "user", "content": [ask, image]}]}).json()
    assert seen["status"] in ("completed", "incomplete") and seen["output"][0]["type"] == "message"
    assert seen["usage"]["input_tokens"] >= text_only["usage"]["input_tokens"] + 16  # the image's patches


async def test_llava_serves_concurrent_requests_in_turn(llava: ModelServerProcess) -> None:
    async with llava.async_client() as client:
        bodies = [vision([ASK, IMAGE], max_tokens=4, seed=i, **NO_EOS) for i in range(3)]
        responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=body) for body in bodies))
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)


def test_llava_refuses_remote_images(llava: ModelServerProcess) -> None:
    remote = {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
    with llava.client() as client:
        assert_error(client.post("/v1/chat/completions", json=vision([ASK, remote])), 400, "data URL")


BAD_TAG = {"type": "text", "text": "<ov_genai_image_3> refers to an image that was not sent"}


def test_llava_refuses_image_markers_typed_in_text_and_keeps_serving(llava: ModelServerProcess) -> None:
    # the pipeline would fail on a marker without its image; the server says what to fix instead
    with llava.client() as client:
        refused = client.post("/v1/chat/completions", json=vision([BAD_TAG, IMAGE]))
        assert_error(refused, 400, "image markers", "image_url")
        as_string = {"model": "llava", "messages": [{"role": "user", "content": "see <ov_genai_image_0>"}]}
        assert_error(client.post("/v1/chat/completions", json=as_string), 400, "image markers")
        assert client.post("/v1/chat/completions", json=vision([ASK, IMAGE])).status_code == 200
