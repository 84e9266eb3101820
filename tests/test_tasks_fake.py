"""Wire shapes and bad input of rerank, transcription, speech and vlm, on the fake engines.

In process (httpx.ASGITransport) for the shapes and errors; one real ``python -m modelserver``
per task at the end checks that the task's routes and engine are wired in.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from tasks_helpers import assert_error, audio_file, image_data_url, sse_events

from modelserver.api.audio import subtitles, within
from modelserver.app import build_app
from modelserver.engines.fake_media import (
    FakeReranker,
    FakeSpeechSynthesizer,
    FakeTranscriber,
    FakeVisionGenerator,
)
from modelserver.engines.media_base import Segment, TranscriptionResult, Word
from modelserver.errors import FATAL_HEADER
from modelserver.spec import ModelSpec, build_model_spec
from tests.openai_schema import check

ENGINES = {"rerank": FakeReranker, "transcription": FakeTranscriber, "speech": FakeSpeechSynthesizer,
           "vlm": FakeVisionGenerator}


def fake_spec(task: str, **extra: Any) -> ModelSpec:
    raw = {"engine": "fake", "task": task, "fake": {"token_delay_s": 0, "load_s": 0}, **extra}
    return build_model_spec("fake", raw)


def client_for(task: str, **extra: Any) -> httpx.AsyncClient:
    spec = fake_spec(task, **extra)
    app = build_app(spec, ENGINES[task](spec))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://modelserver", timeout=60)


@pytest.fixture
async def reranker() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for("rerank") as client:
        yield client


@pytest.fixture
async def transcriber() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for("transcription") as client:
        yield client


@pytest.fixture
async def speaker() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for("speech") as client:
        yield client


@pytest.fixture
async def vlm() -> AsyncIterator[httpx.AsyncClient]:
    async with client_for("vlm") as client:
        yield client


async def assert_fatal(client: httpx.AsyncClient, response: httpx.Response) -> None:
    assert_error(response, 500, "CL_OUT_OF_RESOURCES")
    assert response.headers.get(FATAL_HEADER) == "1"
    health = await client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"


# -- rerank -------------------------------------------------------------------------------------

DOCS = ["stock markets fell sharply", "a black cat sleeps on the mat", "the cat"]


async def test_rerank_ranks_every_document_best_first(reranker: httpx.AsyncClient) -> None:
    body = {"model": "fake", "query": "black cat on the mat", "documents": DOCS}
    response = await reranker.post("/v1/rerank", json=body)
    assert response.status_code == 200, response.text
    body = response.json()
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert results[0]["index"] == 1 and results[-1]["index"] == 0
    assert "document" not in results[0]
    assert body["model"] == "fake" and body["usage"]["total_tokens"] == 5 * 3 + 4 + 7 + 2


async def test_rerank_top_n_and_return_documents(reranker: httpx.AsyncClient) -> None:
    docs = [{"text": d} for d in DOCS]
    response = await reranker.post(
        "/v2/rerank", json={"query": "black cat", "documents": docs, "top_n": 2, "return_documents": True})
    results = response.json()["results"]
    assert len(results) == 2
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"documents": ["a"]}, "query: required field is missing"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": "one string"}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "", "documents": ["a"]}, "query"),
    ],
)
async def test_bad_rerank_requests_are_400(reranker: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    assert_error(await reranker.post("/v1/rerank", json=body), 400, needle)


async def test_rerank_fatal_marker_fails_the_model(reranker: httpx.AsyncClient) -> None:
    await assert_fatal(reranker, await reranker.post("/v1/rerank", json={"query": "[[fatal]]", "documents": ["a"]}))


# -- transcription ------------------------------------------------------------------------------


def upload(data: bytes, name: str = "speech.wav", **fields: Any) -> dict[str, Any]:
    return {"files": {"file": (name, data, "application/octet-stream")}, "data": {"model": "fake", **fields}}


@pytest.mark.parametrize("fmt", ["wav", "flac", "ogg", "mp3"])
async def test_every_audio_format_is_decoded_to_16khz_mono(transcriber: httpx.AsyncClient, fmt: str) -> None:
    # 3 s of 44.1 kHz stereo; the fake reports len(samples) / 16000, so 3.00 means resampled and downmixed
    response = await transcriber.post("/v1/audio/transcriptions", **upload(audio_file(fmt), f"a.{fmt}"))
    assert response.status_code == 200, response.text
    assert response.json()["text"] == "fake transcription of 3.00 seconds of audio"
    assert response.json()["usage"] == {"type": "duration", "seconds": 3}


async def test_verbose_json_has_segments_and_words(transcriber: httpx.AsyncClient) -> None:
    fields = {"response_format": "verbose_json", "timestamp_granularities[]": ["segment", "word"], "language": "en"}
    response = await transcriber.post(
        "/v1/audio/transcriptions", **upload(audio_file("wav", seconds=7.0), **fields))
    body = response.json()
    check(body, "CreateTranscriptionResponseVerboseJson")  # avg_logprob, compression_ratio, no_speech_prob included
    assert body["task"] == "transcribe" and body["language"] == "en" and body["duration"] == 7.0
    assert [(s["start"], s["end"]) for s in body["segments"]] == [(0.0, 5.0), (5.0, 7.0)]
    assert [w["word"] for w in body["words"]] == body["text"].split()
    assert body["words"][-1]["end"] == pytest.approx(7.0)


async def test_text_srt_and_vtt_formats(transcriber: httpx.AsyncClient) -> None:
    data = audio_file("wav", seconds=6.0)
    text = await transcriber.post("/v1/audio/transcriptions", **upload(data, response_format="text"))
    assert text.headers["content-type"].startswith("text/plain") and text.text.startswith("fake transcription")
    srt = await transcriber.post("/v1/audio/transcriptions", **upload(data, response_format="srt"))
    assert srt.text.startswith("1\n00:00:00,000 --> 00:00:05,000\nsegment 1\n\n2\n00:00:05,000 --> 00:00:06,000")
    vtt = await transcriber.post("/v1/audio/transcriptions", **upload(data, response_format="vtt"))
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:05.000\nsegment 1\n")


def test_stamps_past_the_audio_end_at_its_last_sample() -> None:
    # Whisper stamps in 20 ms steps of a 30 s window: its last segment may end after the audio does
    stamped = TranscriptionResult("a b", "en", segments=[Segment(0.0, 2.0, "a"), Segment(2.0, 30.0, "b")],
                                  words=[Word(0.5, 1.0, "a"), Word(6.2, 6.4, "b")])
    result = within(stamped, 6.1)
    assert [(s.start_s, s.end_s) for s in result.segments] == [(0.0, 2.0), (2.0, 6.1)]
    assert [(w.start_s, w.end_s) for w in result.words] == [(0.5, 1.0), (6.1, 6.1)]
    assert subtitles(result.segments, "srt").endswith("00:00:02,000 --> 00:00:06,100\nb\n")


async def test_translations_route(transcriber: httpx.AsyncClient) -> None:
    response = await transcriber.post(
        "/v1/audio/translations", **upload(audio_file("wav"), response_format="verbose_json"))
    check(response.json(), "CreateTranslationResponseVerboseJson")
    assert response.json()["task"] == "translate"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (upload(b"this is not audio"), "could not decode the uploaded audio file"),
        (upload(b""), "empty"),
        ({"data": {"model": "fake"}, "files": {"other": ("x", b"1")}}, "file: required field is missing"),
        (upload(audio_file("wav"), response_format="yaml"), "response_format"),
        (upload(audio_file("wav"), temperature="hot"), "temperature"),
        (upload(audio_file("wav"), **{"timestamp_granularities[]": "word"}), "needs response_format=verbose_json"),
        (upload(audio_file("wav"), stream="true", response_format="srt"), "stream"),
    ],
)
async def test_bad_transcription_requests_are_400(
    transcriber: httpx.AsyncClient, kwargs: dict[str, Any], needle: str
) -> None:
    assert_error(await transcriber.post("/v1/audio/transcriptions", **kwargs), 400, needle)


async def test_streamed_transcription_sends_text_deltas_then_the_whole_text(transcriber: httpx.AsyncClient) -> None:
    response = await transcriber.post("/v1/audio/transcriptions", **upload(audio_file("wav"), stream="true"))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.split("\n\n") if line]
    for event in events:  # the done event ends the stream, as OpenAI's does (no [DONE])
        check(event, "CreateTranscriptionResponseStreamEvent")
    assert [e["type"] for e in events] == ["transcript.text.delta"] * 7 + ["transcript.text.done"]
    assert "".join(e["delta"] for e in events[:-1]).strip() == events[-1]["text"] == (
        "fake transcription of 3.00 seconds of audio")
    refused = await transcriber.post("/v1/audio/transcriptions", **upload(audio_file("wav"), stream="true",
                                                                          prompt="[[error]]"))
    assert refused.status_code == 500  # an error before the first piece is an error answer, not a stream


async def test_transcription_needs_multipart(transcriber: httpx.AsyncClient) -> None:
    response = await transcriber.post("/v1/audio/transcriptions", json={"file": "x"})
    assert_error(response, 400, "multipart/form-data")


async def test_a_20_mb_upload_works_under_the_default_limit(transcriber: httpx.AsyncClient) -> None:
    samples = 20 * 1024 * 1024 // 4  # float32 mono 16 kHz: 327 s, 20 MiB
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(samples, np.float32), 16_000, format="WAV", subtype="FLOAT")
    assert buffer.getbuffer().nbytes > 20 * 1024 * 1024
    response = await transcriber.post("/v1/audio/transcriptions", **upload(buffer.getvalue()))
    assert response.status_code == 200, response.text
    assert response.json()["text"] == f"fake transcription of {samples / 16_000:.2f} seconds of audio"


async def test_an_upload_above_max_request_mb_is_413() -> None:
    async with client_for("transcription", max_request_mb=1) as client:
        response = await client.post("/v1/audio/transcriptions", **upload(audio_file("wav", seconds=10.0)))
    assert_error(response, 413, "1 MiB", "max_request_mb")


async def test_transcription_fatal_marker_fails_the_model(transcriber: httpx.AsyncClient) -> None:
    response = await transcriber.post("/v1/audio/transcriptions", **upload(audio_file("wav"), prompt="[[fatal]]"))
    await assert_fatal(transcriber, response)


# -- speech -------------------------------------------------------------------------------------

SPEECH_TEXT = "Hello there, this is a test."  # 28 characters: 1.68 s of fake speech


@pytest.mark.parametrize(("fmt", "media_type"), [("wav", "audio/wav"), ("flac", "audio/flac"), ("mp3", "audio/mpeg"),
                                                 ("opus", "audio/ogg")])
async def test_speech_formats_decode_to_the_expected_length(
    speaker: httpx.AsyncClient, fmt: str, media_type: str
) -> None:
    response = await speaker.post("/v1/audio/speech", json={"model": "fake", "input": SPEECH_TEXT, "voice": "alloy",
                                                             "response_format": fmt})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == media_type
    samples, rate = soundfile.read(io.BytesIO(response.content))
    assert len(samples) / rate == pytest.approx(len(SPEECH_TEXT) * 0.06, abs=0.1)


async def test_speech_pcm_is_raw_16_bit_and_mp3_is_the_default(speaker: httpx.AsyncClient) -> None:
    pcm = await speaker.post("/v1/audio/speech", json={"input": SPEECH_TEXT, "voice": "x", "response_format": "pcm"})
    assert len(pcm.content) == 2 * int(len(SPEECH_TEXT) * 0.06 * 16_000)
    assert pcm.headers["x-sample-rate"] == "16000"
    default = await speaker.post("/v1/audio/speech", json={"input": SPEECH_TEXT, "voice": "x"})
    assert default.headers["content-type"] == "audio/mpeg"


async def test_speech_speed_shortens_the_audio(speaker: httpx.AsyncClient) -> None:
    async def seconds(speed: float) -> float:
        body = {"input": SPEECH_TEXT, "voice": "x", "response_format": "wav", "speed": speed}
        samples, rate = soundfile.read(io.BytesIO((await speaker.post("/v1/audio/speech", json=body)).content))
        return float(len(samples) / rate)

    assert await seconds(2) == pytest.approx(await seconds(1.0) / 2, rel=0.01)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "hi", "voice": "x", "response_format": "aac"}, "response_format 'aac' is not supported"),
        ({"input": "", "voice": "x"}, "input"),
        ({"voice": "x"}, "input: required field is missing"),
        ({"input": "hi", "voice": "x", "speed": 5}, "speed"),
        ({"input": "hi", "voice": "x", "stream_format": "sse"}, "stream_format"),
        ({"input": "x" * 4097, "voice": "x"}, "input"),
    ],
)
async def test_bad_speech_requests_are_400(speaker: httpx.AsyncClient, body: dict[str, Any], needle: str) -> None:
    assert_error(await speaker.post("/v1/audio/speech", json=body), 400, needle)


async def test_configured_voices_are_enforced() -> None:
    async with client_for("speech", options={"voices": {"anna": "anna.npy"}}) as client:
        ok = await client.post("/v1/audio/speech", json={"input": "hi", "voice": "anna", "response_format": "wav"})
        assert ok.status_code == 200
        assert_error(await client.post("/v1/audio/speech", json={"input": "hi", "voice": "bob"}), 400, "known: anna")


async def test_speech_fatal_marker_fails_the_model(speaker: httpx.AsyncClient) -> None:
    await assert_fatal(speaker, await speaker.post("/v1/audio/speech", json={"input": "[[fatal]]", "voice": "x"}))


# -- vlm ----------------------------------------------------------------------------------------


def vision_chat(*parts: dict[str, Any], **params: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": list(parts)}], **params}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_vlm_images_are_decoded_in_order(vlm: httpx.AsyncClient) -> None:
    body = vision_chat(text("compare"), image(image_data_url(60, 40)), text("with"),
                       {"type": "image_url", "image_url": image_data_url(32, 32, "JPEG")})
    response = await vlm.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "compare [image 60x40] with [image 32x32]"


async def test_vlm_streams_the_same_answer(vlm: httpx.AsyncClient) -> None:
    body = vision_chat(text("what is"), image(image_data_url()))
    whole = (await vlm.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
    streamed = await vlm.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == whole
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_vlm_serves_plain_text_chat_and_completions(vlm: httpx.AsyncClient) -> None:
    chat = await vlm.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "just text"}]})
    assert chat.json()["choices"][0]["message"]["content"] == "just text"
    completion = await vlm.post("/v1/completions", json={"prompt": "raw prompt", "max_tokens": 1})
    assert completion.json()["choices"][0] == {"index": 0, "text": "raw", "logprobs": None, "finish_reason": "length"}


@pytest.mark.parametrize(
    ("part", "needle"),
    [
        (image("https://example.invalid/cat.png"), "makes no outbound requests"),
        (image("http://127.0.0.1/cat.png"), "data URL"),
        (image("data:image/png;base64,@@@not-base64@@@"), "not valid base64"),
        (image("data:image/png," + "A" * 8), "only base64 data URLs"),
        (image("data:image/png;base64,aGVsbG8gd29ybGQ="), "could not decode the image"),
        ({"type": "image_url"}, "image_url"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
    ],
)
async def test_bad_images_are_400_naming_the_part(vlm: httpx.AsyncClient, part: dict[str, Any], needle: str) -> None:
    error = assert_error(await vlm.post("/v1/chat/completions", json=vision_chat(text("x"), part)), 400, needle)
    assert "messages[0].content[1]" in error["message"]


async def test_vlm_fatal_marker_fails_the_model(vlm: httpx.AsyncClient) -> None:
    response = await vlm.post("/v1/chat/completions", json=vision_chat(text("[[fatal]]"), image(image_data_url())))
    await assert_fatal(vlm, response)


# -- the tasks in a real model server process ---------------------------------------------------

PROBES: dict[str, tuple[str, dict[str, Any]]] = {
    "rerank": ("/v1/rerank", {"json": {"query": "q", "documents": ["a", "b"]}}),
    "transcription": ("/v1/audio/transcriptions", upload(audio_file("wav", seconds=1.0))),
    "speech": ("/v1/audio/speech", {"json": {"input": "hi", "voice": "x", "response_format": "wav"}}),
    "vlm": ("/v1/chat/completions", {"json": vision_chat(text("hi"), image(image_data_url()))}),
}


@pytest.mark.parametrize("task", sorted(PROBES))
def test_each_task_is_served_by_python_m_modelserver(task: str) -> None:
    from modelserver_helpers import modelserver

    path, kwargs = PROBES[task]
    with modelserver("--engine", "fake", "--task", task) as server, server.client() as client:
        assert client.post(path, **kwargs).status_code == 200
        assert client.get("/v1/models").json()["data"][0]["task"] == task
        other = "/v1/rerank" if task != "rerank" else "/v1/audio/speech"
        assert_error(client.post(other, json={}), 404, path)


async def test_a_streamed_transcription_stops_decoding_once_the_client_is_gone() -> None:
    spec = fake_spec("transcription", fake={"token_delay_s": 0.02, "load_s": 0})
    engine = FakeTranscriber(spec)
    answers: list[bool] = []  # what each on_text call told the engine: True = stop decoding
    transcribe = engine.transcribe

    async def spying(job: Any) -> Any:
        def on_text(text: str) -> bool:
            answers.append(job.on_text(text))
            return answers[-1]
        return await transcribe(replace(job, on_text=on_text))

    engine.transcribe = spying  # type: ignore[method-assign]
    request = httpx.Request("POST", "http://modelserver/v1/audio/transcriptions",
                            **upload(audio_file("wav", seconds=1.0), stream="true"))
    body = request.read()
    first_delta = asyncio.Event()
    messages = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive() -> dict[str, Any]:
        if (message := next(messages, None)) is not None:
            return message
        await first_delta.wait()
        return {"type": "http.disconnect"}  # the client reads one event and hangs up

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and b"transcript.text.delta" in message.get("body", b""):
            first_delta.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/audio/transcriptions", "raw_path": b"/v1/audio/transcriptions",
             "query_string": b"", "root_path": "", "server": ("modelserver", 80), "client": ("127.0.0.1", 1),
             "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()]}
    await asyncio.wait_for(build_app(spec, engine)(scope, receive, send), 30)
    words = len("fake transcription of 1.00 seconds of audio".split())
    assert answers and answers[-1] is True and len(answers) < words  # told to stop, before the last word
